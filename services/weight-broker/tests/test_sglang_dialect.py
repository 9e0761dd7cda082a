"""What an SGLang-kind engine is sent: only SGLang 0.5.23's routes, `load_format: auto`, plain HF
directories -- never the CPU engine's /rlfleet/ route or an rlfleet load format (an unknown load
format raises in SGLang's scheduler, which then takes the whole server down)."""

from __future__ import annotations

import numpy as np
import pytest
from aiohttp import web

from rlfleet.broker.pools import EngineRef, Pools
from rlfleet.broker.transports import DiskDelta, DiskFull, Pauser, VersionInfo
from rlfleet.common import engine_requests as wire
from rlfleet.common.engine_client import EngineTimeouts
from rlfleet.weights import DirectoryWeightStore
from rlfleet.weights.index import MODEL_FILE
from rlfleet.weights.local_copy import LocalCopies


@pytest.fixture
async def sglang_engine():
    """Answers SGLang's routes (and only those), recording every call."""
    calls: list[tuple[str, dict]] = []

    async def record(request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        calls.append((request.path, body))
        if request.path == "/update_weights_from_disk":
            return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})
        return web.json_response({"message": "ok", "status": "ok"})

    app = web.Application()
    for path in ("/update_weights_from_disk", "/pause_generation", "/continue_generation"):
        app.router.add_post(path, record)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", calls
    await runner.cleanup()


def write_versions(store: DirectoryWeightStore, count: int) -> None:
    rng = np.random.default_rng(0)
    weights = {"model.embed_tokens.weight": (rng.standard_normal((64, 16)) * 0.05).astype(np.float32),
               "model.norm.weight": np.ones(16, dtype=np.float32)}
    for version in range(count):
        store.write_version(version, {k: v.copy() for k, v in weights.items()})
        for value in weights.values():
            value += (1e-3 * np.sign(rng.standard_normal(value.shape))).astype(np.float32)


async def test_an_sglang_engine_gets_only_sglang_routes_and_plain_directories(sglang_engine, tmp_path):
    url, calls = sglang_engine
    store = DirectoryWeightStore(tmp_path / "store", "run1", full_every=100)
    write_versions(store, 3)
    copies = LocalCopies(store, tmp_path / "local")
    pools = Pools([], None, EngineTimeouts(weights_s=10))
    engine = EngineRef("s0", url, "fleet", kind="sglang")
    try:
        (full,) = await DiskFull(pools, Pauser(pools, None), copies=copies).update(
            [engine], VersionInfo.from_store(store, 0))
        loaded = []
        for version in (1, 2):
            (delta,) = await DiskDelta(pools, copies=copies).update([engine],
                                                                    VersionInfo.from_store(store, version))
            assert delta.ok and delta.reply["stage"] == "delta", delta
            loaded.append(calls[-1][1]["model_path"])
    finally:
        await pools.close()
    assert full.ok, full
    sglang_paths = {path for _, path, _ in wire.ROUTES.values()}
    assert {path for path, _ in calls} <= sglang_paths
    assert [path for path, _ in calls] == ["/pause_generation", "/update_weights_from_disk",
                                           "/continue_generation",
                                           "/update_weights_from_disk", "/update_weights_from_disk"]
    disk = [body for path, body in calls if path == "/update_weights_from_disk"]
    assert {body["load_format"] for body in disk} == {"auto"}
    assert [body["weight_version"] for body in disk] == ["0", "1", "2"]
    assert loaded[-1] == str(copies.path(2)) and (copies.path(2) / MODEL_FILE).is_file()
    # The directory holds version 2 exactly as the store rebuilds it.
    from rlfleet.weights.safetensors_io import SafetensorsFile

    with SafetensorsFile(copies.path(2) / MODEL_FILE) as f:
        want = store.load_version(2)
        assert all(f.read(name).tobytes() == want[name].tobytes() for name in want)
