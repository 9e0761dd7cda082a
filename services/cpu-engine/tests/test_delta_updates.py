"""Weight-store loads into an engine (`/rlfleet/update_weights_from_store`): kind delta (fetch + preverify
while serving, pause only for the swap) and full (any version rebuilt exactly), checked bit for bit against
the trainer's published bf16 weights."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from pathlib import Path

import pytest
from aiohttp import web

from rlfleet.engine.server import STORE_ROUTE
from rlfleet.engine.testing import EngineProcess, StoreTrainer, assert_engine_serves
from rlfleet.engine.testing import http_call as call
from rlfleet.weights import DirectoryWeightStore

pytestmark = pytest.mark.integration

PROMPT = [1, 11, 12, 13]


@pytest.fixture(scope="module")
def store_root(tmp_path_factory):
    return tmp_path_factory.mktemp("store")


@pytest.fixture(scope="module")
def trainer(model_dir, store_root):
    """Versions 1 (full) .. 6 (deltas) of one run, written once for the module."""
    trainer = StoreTrainer(model_dir, DirectoryWeightStore(store_root, "run", full_every=100), lr=1e-4)
    trainer.publish()
    for _ in range(5):
        trainer.step()
        trainer.publish()
    return trainer


@pytest.fixture(scope="module")
def store_engine(model_dir, store_root, tmp_path_factory):
    process = EngineProcess(
        model_dir, tmp_path_factory.mktemp("store-engine"), weight_store_root=store_root
    ).start()
    yield process
    process.stop()


async def load(url: str, path, kind: str, **extra):
    body = {"model_path": str(path), "kind": kind, **extra}
    return await call(url, STORE_ROUTE, body)


async def weight_version(url: str) -> str:
    return (await call(url, "/model_info", method="GET"))[1]["weight_version"]


async def test_after_n_delta_updates_the_engine_serves_the_trainers_weights_bit_for_bit(
    store_engine, trainer
):
    url, store = store_engine.url, trainer.store
    status, reply = await load(url, store.path(1), "full")
    assert status == 200 and reply["success"], reply
    await assert_engine_serves(url, trainer.served(1))
    for version in range(2, 7):
        assert store.index(version).kind == "delta"
        status, reply = await load(url, store.path(version), "delta")
        assert status == 200 and reply["success"], reply
        assert reply["weight_version"] == str(version) and reply["base_version"] == version - 1
        assert reply["pause_mode"] == "retract" and 0 <= reply["pause_s"] < 1.0
        assert 0 < reply["bytes"] < store.index(version).full_bytes and 0 < reply["changed_fraction"] <= 1
    await assert_engine_serves(url, trainer.served(6))
    assert await weight_version(url) == "6"
    _, out = await call(url, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}})
    assert out["meta_info"]["weight_version"] == "6"


async def test_store_loads_empty_the_prefix_cache(store_engine, trainer):
    url, store = store_engine.url, trainer.store
    body = {"input_ids": list(range(200, 240)), "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}

    async def cached_tokens() -> int:
        return (await call(url, "/generate", body))[1]["meta_info"]["cached_tokens"]

    assert (await load(url, store.path(1), "full"))[0] == 200
    await cached_tokens()
    assert await cached_tokens() == 39
    assert (await load(url, store.path(2), "delta"))[0] == 200
    assert await cached_tokens() == 0
    assert await cached_tokens() == 39
    assert (await load(url, store.path(2), "full"))[0] == 200
    assert await cached_tokens() == 0


async def test_a_delta_whose_base_the_engine_does_not_hold_is_refused_and_nothing_changes(
    store_engine, trainer
):
    url, store = store_engine.url, trainer.store
    assert (await load(url, store.path(3), "full"))[0] == 200
    status, reply = await load(url, store.path(5), "delta")
    assert status == 400 and not reply["success"]
    assert "base version mismatch" in reply["message"] and "applies to version 4" in reply["message"]
    assert await weight_version(url) == "3"
    await assert_engine_serves(url, trainer.served(3))


async def test_a_full_checkpoint_offered_as_a_delta_is_refused(store_engine, trainer):
    status, reply = await load(store_engine.url, trainer.store.path(1), "delta")
    assert status == 400 and "use kind full" in reply["message"]


async def test_a_corrupt_delta_is_refused_with_the_reason_and_a_full_load_recovers(
    store_engine, trainer, model_dir, tmp_path
):
    # A run of its own, so the shared versions stay intact.
    store = DirectoryWeightStore(trainer.store.root, "corrupt", full_every=100)
    other = StoreTrainer(model_dir, store, lr=1e-4, seed=1)
    other.publish()
    other.step()
    other.publish()
    other.step()
    other.publish()
    url = store_engine.url
    assert (await load(url, store.path(1), "full"))[0] == 200
    payload = store.path(2) / "delta.safetensors"
    data = bytearray(payload.read_bytes())
    for offset in range(len(data) - 400, len(data) - 10, 7):  # inside the last zstd frames
        data[offset] ^= 0x5A
    payload.chmod(0o644)
    payload.write_bytes(bytes(data))

    status, reply = await load(url, store.path(2), "delta")
    assert status == 400 and not reply["success"]
    assert "corrupt or missing delta" in reply["message"] or "preverify" in reply["message"]
    assert await weight_version(url) == "1"
    await assert_engine_serves(url, other.served(1))
    # Version 2 cannot be rebuilt from the store any more: refused too, never served half right.
    status, reply = await load(url, store.path(2), "full")
    assert status == 400 and "cannot be rebuilt exactly" in reply["message"]
    await assert_engine_serves(url, other.served(1))
    # The next full checkpoint brings the engine back to the trainer's weights.
    other.step()
    assert other.publish(kind="full")["kind"] == "full"
    status, reply = await load(url, store.path(4), "full")
    assert status == 200 and reply["store_version"] == 4, reply
    await assert_engine_serves(url, other.served(4))


async def test_a_missing_version_and_a_path_outside_the_store_are_refused(store_engine, trainer, tmp_path):
    url = store_engine.url
    before = await weight_version(url)
    status, reply = await load(url, trainer.store.path(99), "delta")
    assert status == 400 and "version not found" in reply["message"]
    outside = tmp_path / "run" / "v000002"
    outside.mkdir(parents=True)
    status, reply = await load(url, outside, "full")
    assert status == 400 and "outside the weight store root" in reply["message"]
    status, reply = await load(url, trainer.store.path(2), "delta", pause_mode="sideways")
    assert status == 400 and "unknown pause_mode" in reply["error"]["message"]
    assert await weight_version(url) == before


async def test_a_plain_checkpoint_load_makes_the_engine_forget_its_store_version(
    store_engine, trainer, model_dir, store_root
):
    url, store = store_engine.url, trainer.store
    assert (await load(url, store.path(1), "full"))[0] == 200
    _, info = await call(url, "/model_info", method="GET")
    assert info["weight_store_version"] == 1
    # A checkpoint outside the store root is refused (any host path is not the engine's to load) ...
    status, reply = await call(url, "/update_weights_from_disk",
                               {"model_path": str(model_dir), "weight_version": "x"})
    assert status == 403 and "outside the weight store root" in reply["message"]
    _, info = await call(url, "/model_info", method="GET")
    assert info["weight_store_version"] == 1
    # ... and one under it loads.
    plain = shutil.copytree(model_dir, Path(store_root) / "plain-checkpoint", dirs_exist_ok=True)
    status, _ = await call(url, "/update_weights_from_disk",
                           {"model_path": str(plain), "weight_version": "x"})
    assert status == 200
    status, reply = await load(url, store.path(2), "delta")
    assert status == 400 and "holds no weight-store version" in reply["message"]


# --- generation keeps running while a delta is fetched ---------------------------------------------


@pytest.fixture
async def in_process_engine(model_dir, trainer):
    """An engine in this process, so the test can slow down its delta fetch."""
    from rlfleet.engine.config import EngineConfig
    from rlfleet.engine.model_runner import ModelRunner
    from rlfleet.engine.scheduler import Scheduler
    from rlfleet.engine.server import EngineServer

    config = EngineConfig(model_path=model_dir, weight_store_root=trainer.store.root)
    runner = await asyncio.to_thread(ModelRunner, model_dir)
    scheduler = Scheduler(runner, weight_version="default")
    server = EngineServer(config, runner, scheduler)
    scheduler.start()
    app_runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await app_runner.setup()
    site = web.TCPSite(app_runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    scheduler.stop()
    await app_runner.cleanup()


async def test_generation_keeps_running_while_a_delta_is_fetched_and_pauses_only_for_the_swap(
    in_process_engine, trainer, monkeypatch
):
    url, store = in_process_engine, trainer.store
    assert (await load(url, store.path(1), "full"))[0] == 200
    fetch: dict[str, float] = {}
    original = DirectoryWeightStore.fetch_delta

    def slow_fetch(self, version):
        fetch["start"] = time.monotonic()
        time.sleep(1.5)  # a slow shared filesystem
        try:
            return original(self, version)
        finally:
            fetch["end"] = time.monotonic()

    monkeypatch.setattr(DirectoryWeightStore, "fetch_delta", slow_fetch)
    done: list[tuple[float, str, str]] = []
    stop = asyncio.Event()

    async def client() -> None:
        while not stop.is_set():
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
            status, out = await call(url, "/generate", body)
            assert status == 200, out
            meta = out["meta_info"]
            done.append((time.monotonic(), meta["weight_version"], meta["finish_reason"]["type"]))

    clients = [asyncio.create_task(client()) for _ in range(2)]
    await asyncio.sleep(0.3)
    status, reply = await load(url, store.path(2), "delta")
    await asyncio.sleep(0.3)
    stop.set()
    await asyncio.gather(*clients)
    assert status == 200 and reply["success"], reply

    during = [(v, f) for t, v, f in done if fetch["start"] < t < fetch["end"]]
    assert len(during) >= 5, done  # requests completed while the delta was being fetched ...
    assert all(v == "1" and f == "length" for v, f in during)  # ... with the old weights, unaborted
    assert any(v == "2" for t, v, _ in done if t > fetch["end"])
    assert reply["fetch_s"] >= 1.5 and reply["pause_s"] < 0.25  # the pause is the swap only
    assert threading.active_count() < 50
