"""Weights straight from the trainer (issue 16): the real trainer service steps on JetStream groups and
sends each version to two CPU engine processes over the transport the broker chose -- a gloo
broadcast, Mooncake P2P writes into the engines' staging, or same-node shared-memory tensors -- while
the store still gets every version. Afterwards both engines hold exactly the store's bf16 bytes of
the version (read back parameter by parameter) and the broker reports the transport.

A transfer that dies part-way (only some tensors written into staging) is caught by the engine's
checksum check; the engine keeps what it had, and the broker brings it to the version from the store.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from rlfleet.api.broker.v1 import broker_pb2, broker_pb2_grpc
from rlfleet.broker.testing import BrokerProcess
from rlfleet.common.config import NatsConfig
from rlfleet.common.processes import eventually
from rlfleet.common.streams import connect_nats, ensure_streams
from rlfleet.common.testing import unique_run_id
from rlfleet.engine.testing import EngineProcess, assert_engine_serves
from rlfleet.engine.testing import http_call as call
from rlfleet.trainer.testing import TrainerProcess, publish_trajectories, trajectory_protos, write_tiny_model
from rlfleet.weights import DirectoryWeightStore

pytestmark = [pytest.mark.integration, pytest.mark.slow]

G = 4
PROTO = {"distributed": broker_pb2.TRANSPORT_DISTRIBUTED, "p2p": broker_pb2.TRANSPORT_P2P,
         "tensor": broker_pb2.TRANSPORT_TENSOR}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def store_root(tmp_path_factory):
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def engines(model_dir, store_root, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("engines")
    procs = {name: EngineProcess(model_dir, workdir / name, weight_store_root=store_root, engine_id=name)
             for name in ("c0", "f0")}  # fmt: skip
    threads = [threading.Thread(target=p.start) for p in procs.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert all(p.url for p in procs.values()), "an engine did not start"
        yield procs
    finally:
        for p in procs.values():
            p.stop()


@pytest.fixture
def processes():
    started = []
    yield started
    for p in reversed(started):
        p.stop()


def start_broker(processes, tmp_path, run_id, store_root, engines, nats_url, redis_url, transport, **settings):
    listed = [{"engine_id": n, "url": engines[n].url, "pool": "canary" if n == "c0" else "fleet", "kind": "cpu"}
              for n in ("c0", "f0")]
    broker = BrokerProcess(tmp_path / "broker", run_id=run_id, weight_store=str(store_root), engines=listed,
                           auto_promote=True, **{"nats.url": nats_url, "redis.url": redis_url,
                                                 "sync.transport": transport}, **settings).start()  # fmt: skip
    processes.append(broker)
    return broker


async def weight_version(url: str) -> str:
    _, info = await call(url, "/model_info", method="GET")
    return info["weight_version"]


async def both_serve(engines, version: int, store: DirectoryWeightStore) -> None:
    async def check():
        return all([await weight_version(engines[n].url) == str(version) for n in engines])

    await eventually(check, 60.0, message=f"both engines serve version {version}")
    served = store.load_version(version)
    for name in engines:
        await assert_engine_serves(engines[name].url, served)


async def status(broker) -> broker_pb2.BrokerStatus:
    async with grpc.aio.insecure_channel(broker.address) as channel:
        return await broker_pb2_grpc.BrokerServiceStub(channel).GetStatus(broker_pb2.GetStatusRequest())


@pytest.mark.parametrize("transport", ["distributed", "p2p", "tensor"])
async def test_the_trainer_service_sends_each_version_straight_to_two_engines(
    transport, engines, model_dir, store_root, tmp_path, nats_url, redis_url, processes, monkeypatch
):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    run = unique_run_id(f"ts{transport[:2]}")
    store = DirectoryWeightStore(store_root, run)
    broker = start_broker(processes, tmp_path, run, store_root, engines, nats_url, redis_url, transport,
                          reconcile_interval_s=60)  # no store catch-up round may run between the trainer's sends
    trainer = TrainerProcess(tmp_path / "trainer", nats_url, run, None, "--model-path", str(model_dir),
                             "--weight-store", str(store_root), "--weight-send.broker-address", broker.address,
                             "--group-size", str(G), "--groups-per-step", "1", "--optim.lr", "1e-3")
    processes.append(trainer.start())
    await both_serve(engines, 0, store)  # the starting model, sent as version 0

    nc = await connect_nats(NatsConfig(url=nats_url), "test")
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        await publish_trajectories(js, run, trajectory_protos(1, G, run))
        await asyncio.to_thread(trainer.wait_for, lambda s: s.policy_version == 1, 120.0, "version 1")
    finally:
        await nc.close()
    await both_serve(engines, 1, store)
    assert store.latest_version() == 1  # the store has it too: catch-up, audit, rollback

    reported = await status(broker)
    assert {e.engine_id for e in reported.engines} == {"c0", "f0"}
    for engine in reported.engines:
        assert engine.transport == PROTO[transport] and engine.last_transport == PROTO[transport], engine
        assert engine.policy_version == 1 and engine.last_bytes > 0 and not engine.last_error, engine
        assert engine.updates >= 2, engine
    _, metrics = await call(f"http://127.0.0.1:{broker.metrics_port}", "/metrics", method="GET")
    assert f'transport="{transport}"' in metrics
