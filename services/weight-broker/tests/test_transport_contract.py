"""The contract every WeightTransport keeps, checked against a real CPU engine process, for both engine
kinds: `cpu` (the engine's own store route) and `sglang` (only SGLang's routes and load formats: the
broker-mode weight agent's local full copies, loaded with `update_weights_from_disk`, load format auto):

* it brings an engine to the target version, and the engine then serves exactly the trainer's weights;
* an update the engine refuses leaves the engine unchanged, and the outcome is `refused` with the reason;
* an engine that cannot be reached is an outcome (not refused), never an exception.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from rlfleet.broker.pools import EngineRef, Pools
from rlfleet.broker.transports import BroadcastPlan, DiskDelta, DiskFull, Distributed, Pauser, VersionInfo
from rlfleet.common.engine_client import EngineTimeouts
from rlfleet.common.processes import free_port
from rlfleet.engine.testing import StoreTrainer, assert_engine_serves
from rlfleet.engine.testing import http_call as call
from rlfleet.weights import DirectoryWeightStore
from rlfleet.weights.local_copy import LocalCopies

pytestmark = pytest.mark.integration

TRANSPORTS = ["disk_delta", "disk_full", "distributed"]
KINDS = ["cpu", "sglang"]


@pytest.fixture(scope="module")
def trainer(model_dir, store_root):
    trainer = StoreTrainer(model_dir, DirectoryWeightStore(store_root, "contract", full_every=100))
    for _ in range(3):  # v1 full, v2 and v3 deltas
        trainer.publish()
        trainer.step()
    return trainer


@pytest.fixture
async def pools():
    pools = Pools([], None, EngineTimeouts(weights_s=60))
    yield pools
    await pools.close()


@pytest.fixture
def copies(trainer, tmp_path):
    # Under the store root, as the broker's default (<weight_store>/.local-copies): an engine loads
    # plain directories only from under its weight store root.
    return LocalCopies(trainer.store, Path(trainer.store.root) / ".local-copies" / tmp_path.name)


def info_of(trainer, version: int) -> VersionInfo:
    return VersionInfo.from_store(trainer.store, version) if version in trainer.published else VersionInfo(
        version, str(trainer.store.path(version)), "full", None, 0, 0, None)


async def update(name: str, pools: Pools, engine: EngineRef, trainer, version: int, *, bad_name: bool = False,
                 copies: LocalCopies | None = None):
    """One update by transport `name`; for `distributed` this test process is the sender (rank 0)."""
    info = info_of(trainer, version)
    if name == "disk_delta":
        return (await DiskDelta(pools, copies=copies).update([engine], info))[0]
    if name == "disk_full":
        return (await DiskFull(pools, Pauser(pools, None), copies=copies).update([engine], info))[0]
    import torch

    from rlfleet.weights import broadcast as distributed
    from rlfleet.weights.torch_io import to_torch

    named = [(n, t) for n, t in to_torch(trainer.served(version)).items() if n in trainer.served(version)]
    names = [("no.such.weight" if bad_name and i == 0 else n) for i, (n, _) in enumerate(named)]
    port = free_port()
    plan = BroadcastPlan("127.0.0.1", port, f"contract-{port}", "gloo", names,
                         [str(t.dtype).removeprefix("torch.") for _, t in named],
                         [list(t.shape) for _, t in named])

    def send() -> None:
        group = distributed.join_group("127.0.0.1", port, 0, 2, plan.group_name, "gloo", 30.0)
        try:
            distributed.send(group, [t for _, t in named])
        finally:
            distributed.leave_group(group)

    assert all(isinstance(t, torch.Tensor) for _, t in named)
    receiving = asyncio.create_task(Distributed(pools, plan).update([engine], info))
    if engine.url.endswith(":1"):
        return (await receiving)[0]
    await asyncio.to_thread(send)
    return (await receiving)[0]


async def hold(pools: Pools, ref: EngineRef, trainer, version: int, copies: LocalCopies) -> None:
    """The engine serves `version` (by a full load of its kind: the agent then holds its copy)."""
    outcome = await update("disk_full", pools, ref, trainer, version, copies=copies)
    assert outcome.ok, outcome


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", TRANSPORTS)
async def test_a_transport_brings_an_engine_to_the_version_with_the_trainers_exact_weights(
    name, kind, engine, trainer, pools, copies, monkeypatch
):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    ref = EngineRef("e0", engine.url, "fleet", kind=kind)
    await hold(pools, ref, trainer, 1, copies)
    outcome = await update(name, pools, ref, trainer, 2, copies=copies)
    assert outcome.ok and outcome.transport == name and outcome.version == 2, outcome
    assert outcome.bytes > 0 and outcome.pause_s >= 0
    assert (await call(engine.url, "/model_info", method="GET"))[1]["weight_version"] == "2"
    await assert_engine_serves(engine.url, trainer.served(2))
    if kind == "sglang" and name != "distributed":
        # Loaded from the agent's plain HF directory, with SGLang's own load format; the delta was
        # applied to the local copy (the store's delta bytes were read, not the whole version).
        assert outcome.reply["local_copy"] == str(copies.path(2)) and copies.held("e0") == 2
        if name == "disk_delta":
            assert outcome.reply["stage"] == "delta" and outcome.bytes < trainer.store.index(1).total_bytes


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", TRANSPORTS)
async def test_an_update_the_engine_refuses_leaves_it_unchanged_and_says_why(
    name, kind, engine, trainer, pools, copies, monkeypatch
):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    ref = EngineRef("e0", engine.url, "fleet", kind=kind)
    await hold(pools, ref, trainer, 1, copies)
    if name == "disk_delta":
        outcome = await update(name, pools, ref, trainer, 3, copies=copies)  # v3 applies to v2; it holds v1
        expected = "base version mismatch" if kind == "cpu" else "delta needs base version 2"
    elif name == "disk_full":
        outcome = await update(name, pools, ref, trainer, 42, copies=copies)  # not in the store
        expected = "version not found" if kind == "cpu" else "42"
    else:
        outcome = await update(name, pools, ref, trainer, 2, bad_name=True)
        expected = "unknown parameter names"
    assert not outcome.ok and outcome.refused and expected in outcome.message.lower(), outcome
    assert (await call(engine.url, "/model_info", method="GET"))[1]["weight_version"] == "1"
    await assert_engine_serves(engine.url, trainer.served(1))
    status, load = await call(engine.url, "/server_info", method="GET")
    assert status == 200 and load["paused"] is None  # a full load resumes the engine it paused


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", TRANSPORTS)
async def test_an_unreachable_engine_is_an_outcome_not_an_exception(name, kind, trainer, pools, copies):
    if kind == "sglang" and name == "disk_delta":
        copies.commit(copies.stage_full(1), holder="gone")  # so the delta stages and the load is tried
    outcome = await update(name, pools, EngineRef("gone", "http://127.0.0.1:1", "fleet", kind=kind),
                           trainer, 2, copies=copies)
    assert not outcome.ok and not outcome.refused and outcome.engine_id == "gone"


async def test_a_delta_updated_engine_and_a_full_reload_one_end_bit_identical(
    engine, model_dir, store_root, trainer, pools, copies, tmp_path
):
    """Three ways to version 3 -- in-engine deltas (cpu), deltas on the agent's local copy (sglang), one
    full reload -- give the same bits, and those are the trainer's."""
    from rlfleet.engine.testing import EngineProcess, read_engine_weights

    second = EngineProcess(model_dir, tmp_path / "second", weight_store_root=store_root).start()
    try:
        cpu, agent = (EngineRef("a", engine.url, "fleet", kind="cpu"),
                      EngineRef("b", second.url, "fleet", kind="sglang"))
        for ref in (cpu, agent):
            await hold(pools, ref, trainer, 1, copies)
            for version in (2, 3):
                outcome = await update("disk_delta", pools, ref, trainer, version, copies=copies)
                assert outcome.ok and outcome.transport == "disk_delta", outcome
        names = list(trainer.served(3))
        by_delta, by_agent = (await read_engine_weights(engine.url, names),
                              await read_engine_weights(second.url, names))
        outcome = await update("disk_full", pools, cpu, trainer, 3, copies=copies)  # a full reload of v3
        assert outcome.ok, outcome
        reloaded = await read_engine_weights(engine.url, names)
        for name in names:
            assert (torch.equal(by_delta[name], reloaded[name])
                    and torch.equal(by_agent[name], reloaded[name])), name
        await assert_engine_serves(engine.url, trainer.served(3))
    finally:
        second.stop()
