"""The contract every WeightTransport keeps, checked against a real CPU engine process:

* it brings an engine to the target version, and the engine then serves exactly the trainer's weights;
* an update the engine refuses leaves the engine unchanged, and the outcome is `refused` with the reason;
* an engine that cannot be reached is an outcome (not refused), never an exception.
"""

from __future__ import annotations

import asyncio

import pytest

from rlfleet.broker.pools import EngineRef, Pools
from rlfleet.broker.transports import BroadcastPlan, DiskDelta, DiskFull, Distributed, Pauser, VersionInfo
from rlfleet.common.engine_client import EngineTimeouts
from rlfleet.common.processes import free_port
from rlfleet.engine.testing import StoreTrainer, assert_engine_serves
from rlfleet.engine.testing import http_call as call
from rlfleet.weights import DirectoryWeightStore

pytestmark = pytest.mark.integration

TRANSPORTS = ["disk_delta", "disk_full", "distributed"]


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


async def update(name: str, pools: Pools, engine: EngineRef, trainer, version: int, *, bad_name: bool = False):
    """One update by transport `name`; for `distributed` this test process is the sender (rank 0)."""
    info = VersionInfo.from_store(trainer.store, version) if version in trainer.published else VersionInfo(
        version, str(trainer.store.path(version)), "full", None, 0, 0, None)
    if name == "disk_delta":
        return (await DiskDelta(pools).update([engine], info))[0]
    if name == "disk_full":
        return (await DiskFull(pools, Pauser(pools, None)).update([engine], info))[0]
    import torch

    from rlfleet.engine import distributed
    from rlfleet.weights.torch_io import to_torch

    named = [(n, t) for n, t in to_torch(trainer.served(version)).items() if n in trainer.served(version)]
    names = [("no.such.weight" if bad_name and i == 0 else n) for i, (n, _) in enumerate(named)]
    port = free_port()
    plan = BroadcastPlan("127.0.0.1", port, f"contract-{port}", "gloo", names,
                         [str(t.dtype).removeprefix("torch.") for _, t in named], [list(t.shape) for _, t in named])

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


async def hold(url: str, trainer, version: int) -> None:
    body = {"model_path": str(trainer.store.path(version)), "load_format": "rlfleet_full"}
    status, reply = await call(url, "/update_weights_from_disk", body)
    assert status == 200, reply


@pytest.mark.parametrize("name", TRANSPORTS)
async def test_a_transport_brings_an_engine_to_the_version_with_the_trainers_exact_weights(
    name, engine, trainer, pools, monkeypatch
):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    await hold(engine.url, trainer, 1)
    ref = EngineRef("e0", engine.url, "fleet")
    outcome = await update(name, pools, ref, trainer, 2)
    assert outcome.ok and outcome.transport == name and outcome.version == 2, outcome
    assert outcome.bytes > 0 and outcome.pause_s >= 0
    assert (await call(engine.url, "/model_info", method="GET"))[1]["weight_version"] == "2"
    await assert_engine_serves(engine.url, trainer.served(2))


@pytest.mark.parametrize("name", TRANSPORTS)
async def test_an_update_the_engine_refuses_leaves_it_unchanged_and_says_why(
    name, engine, trainer, pools, monkeypatch
):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    await hold(engine.url, trainer, 1)
    ref = EngineRef("e0", engine.url, "fleet")
    if name == "disk_delta":
        outcome = await update(name, pools, ref, trainer, 3)  # v3 applies to v2, the engine holds v1
        expected = "base version mismatch"
    elif name == "disk_full":
        outcome = await update(name, pools, ref, trainer, 42)  # not in the store
        expected = "version not found"
    else:
        outcome = await update(name, pools, ref, trainer, 2, bad_name=True)
        expected = "unknown parameter names"
    assert not outcome.ok and outcome.refused and expected in outcome.message, outcome
    assert (await call(engine.url, "/model_info", method="GET"))[1]["weight_version"] == "1"
    await assert_engine_serves(engine.url, trainer.served(1))
    status, load = await call(engine.url, "/server_info", method="GET")
    assert status == 200 and load["paused"] is None  # a full load resumes the engine it paused


@pytest.mark.parametrize("name", TRANSPORTS)
async def test_an_unreachable_engine_is_an_outcome_not_an_exception(name, trainer, pools):
    outcome = await update(name, pools, EngineRef("gone", "http://127.0.0.1:1", "fleet"), trainer, 2)
    assert not outcome.ok and not outcome.refused and outcome.engine_id == "gone"
