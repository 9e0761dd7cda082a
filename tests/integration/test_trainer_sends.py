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
from rlfleet.common.grpc_server import channel as open_channel
from rlfleet.common.processes import eventually
from rlfleet.common.streams import connect_nats, ensure_streams
from rlfleet.common.testing import unique_run_id
from rlfleet.engine.testing import assert_engine_serves
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
    async with open_channel(broker.address) as channel:
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


class DiesPartWay:
    """A trainer-side sender whose P2P write to one engine stops half-way (the connection died after
    some buckets) without the sender noticing: it reports the write as sent."""

    def __init__(self, config, victim: str) -> None:
        from rlfleet.trainer.weight_sender import WeightSender

        class Sender(WeightSender):
            def _write_peer(self, peer, named, bucket_bytes, summary):
                if peer.engine_id != victim:
                    return super()._write_peer(peer, named, bucket_bytes, summary)
                import json

                from rlfleet.weights.p2p import Endpoint

                endpoint = Endpoint.from_json(json.loads(peer.endpoint_json))
                by_name = dict(named)
                half = set(list(endpoint.tensors)[: len(endpoint.tensors) // 2])
                report = self._sender(bucket_bytes).send({n: by_name[n] for n in endpoint.tensors}, endpoint,
                                                         only=half)
                return broker_pb2.PeerResult(engine_id=peer.engine_id, sent=True, bytes=report.bytes_sent)

        self.sender = Sender(config)


async def test_a_p2p_transfer_that_dies_part_way_is_refused_and_the_engine_loads_the_version_from_the_store(
    engines, model_dir, store_root, tmp_path, nats_url, redis_url, processes
):
    from rlfleet.broker.testing import policy_version
    from rlfleet.engine.testing import StoreTrainer
    from rlfleet.trainer.service_config import WeightSendConfig

    run = unique_run_id("tsk")
    store = DirectoryWeightStore(store_root, run)
    broker = start_broker(processes, tmp_path, run, store_root, engines, nats_url, redis_url, "p2p")
    trainer = StoreTrainer(model_dir, store)
    trainer.publish()
    trainer.step()
    # Version 2 (no earlier test of this module reaches it, so no engine holds a version of that number);
    # it is in the store before anything is sent.
    manifest = trainer.publish()
    sender = DiesPartWay(WeightSendConfig(broker_address=broker.address), victim="c0").sender
    try:
        summary = await asyncio.to_thread(sender.send, policy_version(manifest), trainer.model.state_dict())
    finally:
        sender.close()
    by_engine = {o.engine_id: o for o in summary.outcomes}
    assert by_engine["f0"].ok and by_engine["f0"].transport == broker_pb2.TRANSPORT_P2P
    assert not by_engine["c0"].ok and by_engine["c0"].falls_back
    assert "wrong checksum" in by_engine["c0"].message, by_engine["c0"]

    await both_serve(engines, manifest["version"], store)  # c0 by the store, bit for bit the same
    reported = {e.engine_id: e for e in (await status(broker)).engines}
    assert reported["f0"].last_transport == broker_pb2.TRANSPORT_P2P
    assert reported["c0"].last_transport in (broker_pb2.TRANSPORT_DISK_FULL, broker_pb2.TRANSPORT_DISK_DELTA)
    assert reported["c0"].policy_version == manifest["version"] and reported["c0"].transport == broker_pb2.TRANSPORT_P2P


def send_beside_store(sender, trainer, store_fails: str = ""):
    """What the trainer service does (`weight_send.beside_store`): the send starts with only the version's
    number while the store write runs; the write's outcome (the stored version, or its error) follows."""
    from concurrent.futures import Future

    from rlfleet.api.common.v1 import common_pb2
    from rlfleet.broker.testing import policy_version

    stored: Future = Future()
    version = trainer.version + 1
    partial = common_pb2.PolicyVersion(schema_version=common_pb2.SCHEMA_VERSION_1, version=version,
                                       parent_version=version - 1)  # fmt: skip

    def write() -> None:
        if store_fails:
            stored.set_exception(OSError(store_fails))
            return
        stored.set_result(policy_version(trainer.publish()))

    writer = threading.Thread(target=write)
    writer.start()
    try:
        return version, sender.send(partial, trainer.model.state_dict(), stored)
    finally:
        writer.join()


class FailsToReach:
    """A trainer-side sender whose P2P write to one engine fails outright (the peer is unreachable)."""

    def __init__(self, config, victim: str) -> None:
        from rlfleet.trainer.weight_sender import WeightSender

        class Sender(WeightSender):
            def _write_peer(self, peer, named, bucket_bytes, summary):
                if peer.engine_id != victim:
                    return super()._write_peer(peer, named, bucket_bytes, summary)
                return broker_pb2.PeerResult(engine_id=peer.engine_id, error="connection refused")

        self.sender = Sender(config)


class CorruptsTheBroadcast:
    """A trainer-side sender whose broadcast carries one tensor with a flipped value (after the
    checksums were taken), as a corrupted transfer would."""

    def __init__(self, config) -> None:
        import torch

        from rlfleet.trainer.weight_sender import WeightSender

        class Sender(WeightSender):
            def _start_broadcast(self, plan, request, named, summary):
                bad = [(n, t.clone()) for n, t in named]
                bad[0][1].view(-1)[0] += torch.tensor(1.0, dtype=bad[0][1].dtype)
                return super()._start_broadcast(plan, request, bad, summary)

        self.sender = Sender(config)


async def test_a_p2p_write_that_fails_beside_the_store_write_falls_back_to_the_store(
    engines, model_dir, store_root, tmp_path, nats_url, redis_url, processes
):
    from rlfleet.engine.testing import StoreTrainer
    from rlfleet.trainer.service_config import WeightSendConfig

    run = unique_run_id("tsf")
    store = DirectoryWeightStore(store_root, run)
    broker = start_broker(processes, tmp_path, run, store_root, engines, nats_url, redis_url, "p2p")
    trainer = StoreTrainer(model_dir, store)
    for _ in range(2):  # versions 1, 2 in the store only; version 3 is written beside the send
        trainer.publish()
        trainer.step()
    sender = FailsToReach(WeightSendConfig(broker_address=broker.address), victim="c0").sender
    try:
        version, summary = await asyncio.to_thread(send_beside_store, sender, trainer)
    finally:
        sender.close()
    assert version == 3 and store.latest_version() == 3 and not summary.error
    by_engine = {o.engine_id: o for o in summary.outcomes}
    assert by_engine["f0"].ok and by_engine["f0"].transport == broker_pb2.TRANSPORT_P2P, by_engine["f0"]
    assert not by_engine["c0"].ok and by_engine["c0"].falls_back and "connection refused" in by_engine["c0"].message

    await both_serve(engines, version, store)  # c0 by the store, bit for bit the same
    reported = {e.engine_id: e for e in (await status(broker)).engines}
    assert reported["f0"].last_transport == broker_pb2.TRANSPORT_P2P
    assert reported["c0"].last_transport in (broker_pb2.TRANSPORT_DISK_FULL, broker_pb2.TRANSPORT_DISK_DELTA)


async def test_a_failed_store_write_beside_the_send_rejects_the_version_and_no_engine_serves_it(
    engines, model_dir, store_root, tmp_path, nats_url, redis_url, processes
):
    from rlfleet.engine.testing import StoreTrainer
    from rlfleet.trainer.service_config import WeightSendConfig

    run = unique_run_id("tss")
    store = DirectoryWeightStore(store_root, run)
    broker = start_broker(processes, tmp_path, run, store_root, engines, nats_url, redis_url, "p2p")
    trainer = StoreTrainer(model_dir, store)
    for _ in range(3):
        trainer.publish()
        trainer.step()
    before = {n: await weight_version(engines[n].url) for n in engines}
    sender = WeightSendConfig(broker_address=broker.address)
    from rlfleet.trainer.weight_sender import WeightSender

    sender = WeightSender(sender)
    try:
        version, summary = await asyncio.to_thread(send_beside_store, sender, trainer, "No space left on device")
    finally:
        sender.close()
    assert version == 4 and store.latest_version() == 3
    assert {o.engine_id for o in summary.outcomes} == {"c0", "f0"}
    for outcome in summary.outcomes:  # both were written over P2P, and neither flipped it in
        assert not outcome.ok and "version rejected" in outcome.message and "No space left" in outcome.message
    assert summary.bytes.get("p2p", 0) > 0
    assert {n: await weight_version(engines[n].url) for n in engines} == before
    async with open_channel(broker.address) as channel:
        listed = await broker_pb2_grpc.BrokerServiceStub(channel).ListVersions(broker_pb2.ListVersionsRequest())
    (record,) = [r for r in listed.versions if r.version.version == version]
    assert record.state == broker_pb2.VERSION_STATE_REJECTED and "store write failed" in record.reason, record
    reported = await status(broker)
    assert reported.canary_version != version and reported.fleet_version != version


async def test_a_corrupted_broadcast_is_refused_from_staging_and_the_engines_load_the_version_from_the_store(
    engines, model_dir, store_root, tmp_path, nats_url, redis_url, processes, monkeypatch
):
    from rlfleet.engine.testing import StoreTrainer
    from rlfleet.trainer.service_config import WeightSendConfig

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    run = unique_run_id("tsc")
    store = DirectoryWeightStore(store_root, run)
    broker = start_broker(processes, tmp_path, run, store_root, engines, nats_url, redis_url, "distributed")
    trainer = StoreTrainer(model_dir, store)
    for _ in range(4):
        trainer.publish()
        trainer.step()
    sender = CorruptsTheBroadcast(WeightSendConfig(broker_address=broker.address)).sender
    try:
        version, summary = await asyncio.to_thread(send_beside_store, sender, trainer)
    finally:
        sender.close()
    assert version == 5
    assert {o.engine_id for o in summary.outcomes} == {"c0", "f0"}
    for outcome in summary.outcomes:  # refused by each engine when asked to flip it in: nothing served
        assert not outcome.ok and outcome.falls_back and "staged weights refused" in outcome.message, outcome
        assert outcome.transport == broker_pb2.TRANSPORT_DISTRIBUTED
    await both_serve(engines, version, store)  # then from the store, bit for bit the trainer's


async def test_bad_trainer_sync_requests_get_clear_statuses(engines, store_root, tmp_path, nats_url, redis_url,
                                                            processes, model_dir):
    from rlfleet.broker.testing import policy_version
    from rlfleet.engine.testing import StoreTrainer

    run = unique_run_id("tsb")
    broker = start_broker(processes, tmp_path, run, store_root, engines, nats_url, redis_url, "p2p")
    manifest = StoreTrainer(model_dir, DirectoryWeightStore(store_root, run)).publish()
    spec = broker_pb2.TensorSpec(name="w", dtype="bfloat16", shape=[2])
    async with open_channel(broker.address) as channel:
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        for request, words in [
            (broker_pb2.StartTrainerSyncRequest(version=policy_version(manifest), checksum_algorithm="sha256"),
             "needs the tensors"),
            (broker_pb2.StartTrainerSyncRequest(version=policy_version(manifest), tensors=[spec],
                                                checksum_algorithm="sha256"), "checksum"),
            (broker_pb2.StartTrainerSyncRequest(version=policy_version(manifest), tensors=[spec],
                                                checksum_algorithm="md5"), "md5"),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.StartTrainerSync(request)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.FinishTrainerSync(broker_pb2.FinishTrainerSyncRequest(sync_id="nope"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
