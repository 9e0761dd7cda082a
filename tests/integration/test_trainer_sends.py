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
from concurrent.futures import Future

import grpc
import pytest

from rlfleet.api.broker.v1 import broker_pb2, broker_pb2_grpc
from rlfleet.api.common.v1 import common_pb2
from rlfleet.broker.testing import BrokerProcess, policy_version
from rlfleet.common.config import NatsConfig
from rlfleet.common.grpc_server import channel as open_channel
from rlfleet.common.processes import eventually
from rlfleet.common.streams import connect_nats, ensure_streams
from rlfleet.common.testing import unique_run_id
from rlfleet.engine.testing import assert_engine_serves, to_served
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


def start_broker(processes, tmp_path, run_id, store_root, engines, nats_url, redis_url,
                 transport, **settings):
    listed = [{"engine_id": n, "url": engines[n].url, "pool": "canary" if n == "c0" else "fleet",
               "kind": "cpu"} for n in ("c0", "f0")]
    broker = BrokerProcess(tmp_path / "broker", run_id=run_id, weight_store=str(store_root), engines=listed,
                           auto_promote=True, **{"nats.url": nats_url, "redis.url": redis_url,
                                                 "sync.transport": transport},
                           **settings).start()  # fmt: skip
    processes.append(broker)
    return broker


async def weight_version(url: str) -> str:
    _, info = await call(url, "/model_info", method="GET")
    return info["weight_version"]


async def both_serve(engines, version: int, store: DirectoryWeightStore) -> None:
    async def check():
        return all([await weight_version(engines[n].url) == str(version) for n in engines])

    await eventually(check, 60.0, message=f"both engines serve version {version}")
    # Engines may flip a version in before the trainer's store write is done (flip_before_stored).
    await eventually(lambda: version in store.list_versions(), 60.0,
                     message=f"version {version} in the store")
    served = store.load_version(version)
    for name in engines:
        await assert_engine_serves(engines[name].url, served)


async def relabel(engines, run: str) -> None:
    """The engines are shared with other tests' runs: no version label of theirs may pass for one of
    `run`'s (an engine that took a version straight from a trainer names no store directory)."""
    for name in engines:
        await call(engines[name].url, "/update_weight_version", {"new_version": f"before-{run}"})


async def served_from_the_store(engines, broker, store: DirectoryWeightStore, model_dir, versions: int):
    """A stand-in trainer writes `versions` versions to the store; the broker publishes the last one and
    both engines serve it (the version the pools fall back to). Returns the stand-in trainer."""
    from rlfleet.engine.testing import StoreTrainer

    trainer = StoreTrainer(model_dir, store)
    for _ in range(versions):
        manifest = trainer.publish()
        trainer.step()
    await relabel(engines, store.run_id)
    async with open_channel(broker.address) as channel:
        await broker_pb2_grpc.BrokerServiceStub(channel).PublishVersion(policy_version(manifest))
    await both_serve(engines, versions, store)
    return trainer


async def status(broker) -> broker_pb2.BrokerStatus:
    async with open_channel(broker.address) as channel:
        return await broker_pb2_grpc.BrokerServiceStub(channel).GetStatus(broker_pb2.GetStatusRequest())


async def train_version_1(trainer: TrainerProcess, nats_url: str, run: str, groups: int,
                          timeout_s: float) -> None:
    """Publishes `groups` groups of trajectories for the trainer and waits for it to make version 1."""
    nc = await connect_nats(NatsConfig(url=nats_url), "test")
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        await publish_trajectories(js, run, trajectory_protos(groups, G, run))
        await asyncio.to_thread(trainer.wait_for, lambda s: s.policy_version == 1, timeout_s, "version 1")
    finally:
        await nc.close()


@pytest.mark.parametrize("transport", ["distributed", "p2p", "tensor"])
async def test_the_trainer_service_sends_each_version_straight_to_two_engines(
    transport, engines, model_dir, store_root, tmp_path, nats_url, redis_url, processes, monkeypatch
):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    run = unique_run_id(f"ts{transport[:2]}")
    store = DirectoryWeightStore(store_root, run)
    # no store catch-up round may run between the trainer's sends
    broker = start_broker(processes, tmp_path, run, store_root, engines, nats_url, redis_url, transport,
                          reconcile_interval_s=60)
    trainer = TrainerProcess(tmp_path / "trainer", nats_url, run, None, "--model-path", str(model_dir),
                             "--weight-store", str(store_root),
                             "--weight-send.broker-address", broker.address,
                             "--group-size", str(G), "--groups-per-step", "1", "--optim.lr", "1e-3")
    processes.append(trainer.start())
    await both_serve(engines, 0, store)  # the starting model, sent as version 0

    await train_version_1(trainer, nats_url, run, 1, 120.0)
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


async def served_checksums(url: str, names) -> dict[str, str]:
    """The engine's weights as the bf16 bytes it serves, hashed per tensor (as the trainer hashes what
    it sends)."""
    import torch

    from rlfleet.engine.testing import read_engine_weights
    from rlfleet.weights.sent import tensor_checksums

    got = await read_engine_weights(url, names)
    return tensor_checksums([(n, got[n].to(torch.bfloat16)) for n in names])


def store_checksums(store: DirectoryWeightStore, version: int) -> dict[str, str]:
    import torch

    from rlfleet.weights.sent import tensor_checksums

    served = store.load_version(version)
    return tensor_checksums([
        (n, torch.from_numpy(served.to_float32(n).reshape(served[n].shape)).to(torch.bfloat16))
        for n in served])


class StagingScribbler:
    """A third party writing garbage into one tensor of an engine's P2P staging, over and over, through
    Mooncake (the endpoint the engine publishes): whatever the trainer writes there is overwritten, as
    a transfer corrupted on the way would arrive."""

    def __init__(self, endpoint_json: dict, interval_s: float = 0.002) -> None:
        import torch

        from rlfleet.weights.p2p import Endpoint, TransferAgent

        self.endpoint = Endpoint.from_json(endpoint_json)
        self.name, self.target = max(self.endpoint.tensors.items(), key=lambda kv: kv[1].nbytes)
        self.agent = TransferAgent()
        self.garbage = torch.full((self.target.nbytes,), 0xA5, dtype=torch.uint8)
        self.agent.register(self.garbage)
        self.interval_s = interval_s
        self.writes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scribbler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.agent.write(self.endpoint.session_id, [self.garbage.data_ptr()], [self.target.ptr],
                             [self.target.nbytes])
            self.writes += 1
            self._stop.wait(self.interval_s)

    def __enter__(self) -> StagingScribbler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10.0)
        self.agent.unregister(self.garbage)


async def test_the_trainer_service_p2p_transfer_corrupted_on_the_way_falls_back_to_the_store_for_that_engine(
    engines, model_dir, store_root, tmp_path, nats_url, redis_url, processes
):
    """The real trainer service sends version 1 over P2P to both engines while a third party keeps
    overwriting one tensor of c0's staging: c0's checksum check refuses it (its model untouched), the
    broker brings c0 the version from the store's delta, f0 takes it over P2P, and both then hold the
    store's bytes exactly (per-tensor checksums equal)."""
    run = unique_run_id("tsx")
    store = DirectoryWeightStore(store_root, run)
    broker = start_broker(processes, tmp_path, run, store_root, engines, nats_url, redis_url, "p2p")
    trainer = TrainerProcess(tmp_path / "trainer", nats_url, run, None, "--model-path", str(model_dir),
                             "--weight-store", str(store_root),
                             "--weight-send.broker-address", broker.address,
                             "--group-size", str(G), "--groups-per-step", "1", "--optim.lr", "1e-3")
    processes.append(trainer.start())
    await both_serve(engines, 0, store)
    status_code, endpoint = await call(engines["c0"].url, "/remote_instance_transfer_engine_info?rank=0",
                                       method="GET")
    assert status_code == 200, endpoint

    with StagingScribbler(endpoint) as scribbler:
        await train_version_1(trainer, nats_url, run, 1, 120.0)
        await both_serve(engines, 1, store)  # c0 from the store's delta, f0 straight from the trainer
    assert scribbler.writes > 0
    assert store.index(1).kind == "delta"

    names = list(store.load_version(1))
    want = store_checksums(store, 1)
    for name in engines:  # bit-identical: the store's bytes, checked tensor by tensor
        assert await served_checksums(engines[name].url, names) == want, name
    reported = {e.engine_id: e for e in (await status(broker)).engines}
    assert reported["f0"].last_transport == broker_pb2.TRANSPORT_P2P and reported["f0"].policy_version == 1
    assert reported["c0"].last_transport == broker_pb2.TRANSPORT_DISK_DELTA, reported["c0"]
    assert reported["c0"].policy_version == 1 and reported["c0"].transport == broker_pb2.TRANSPORT_P2P
    _, metrics = await call(f"http://127.0.0.1:{broker.metrics_port}", "/metrics", method="GET")
    refused = [line for line in metrics.splitlines() if line.startswith("rlfleet_broker_updates_total")
               and 'transport="p2p"' in line and 'outcome="refused"' in line]
    assert refused and float(refused[0].rsplit(" ", 1)[1]) >= 1, refused
    assert "['c0'] fall back to the store" in trainer.log(), trainer.log()[-2000:]


@pytest.mark.parametrize("every_rank", [False, True], ids=["rank0-gathers", "every-rank-shards"])
async def test_the_trainer_service_under_torchrun_sends_p2p_to_two_engines(
    every_rank, engines, model_dir, store_root, tmp_path, nats_url, redis_url, processes, monkeypatch
):
    """Two FSDP2 ranks: rank 0 plans and reports; the P2P bytes come from rank 0's gathered state, or
    (`weight_send.p2p_every_rank`) each rank writes its own rows. Either way both engines then hold
    the store's bytes of each version exactly (per-tensor checksums)."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    run = unique_run_id("tsr")
    store = DirectoryWeightStore(store_root, run)
    broker = start_broker(processes, tmp_path, run, store_root, engines, nats_url, redis_url, "p2p",
                          reconcile_interval_s=60)  # every version must come from the trainer
    trainer = TrainerProcess(tmp_path / "trainer", nats_url, run, None, "--model-path", str(model_dir),
                             "--weight-store", str(store_root),
                             "--weight-send.broker-address", broker.address,
                             "--weight-send.p2p-every-rank", str(every_rank).lower(),
                             "--group-size", str(G), "--groups-per-step", "2", "--optim.lr", "1e-3", nproc=2)
    processes.append(trainer.start(timeout_s=180))
    await both_serve(engines, 0, store)
    await train_version_1(trainer, nats_url, run, 2, 180.0)
    await both_serve(engines, 1, store)
    names = list(store.load_version(1))
    want = store_checksums(store, 1)
    for name in engines:
        assert await served_checksums(engines[name].url, names) == want, name
    reported = {e.engine_id: e for e in (await status(broker)).engines}
    for engine in reported.values():
        assert engine.last_transport == broker_pb2.TRANSPORT_P2P and engine.policy_version == 1, engine
    log = trainer.log()
    lines = [line for line in log.splitlines() if "P2P shards written by 2 ranks" in line]
    if not every_rank:
        assert not lines
        return
    assert len(lines) >= 2, log[-3000:]  # versions 0 and 1
    last = lines[-1]
    for engine_id in ("c0", "f0"):
        part = last.split(f"{engine_id} rank 0 ", 1)[1].split(";")[0]
        rank0, rank1 = int(part.split(" B")[0]), int(part.split("rank 1 ", 1)[1].split(" B")[0])
        assert rank0 > 0 and rank1 > 0 and "FAILED" not in part, last


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
    assert (reported["c0"].policy_version == manifest["version"]
            and reported["c0"].transport == broker_pb2.TRANSPORT_P2P)


def send_beside_store(sender, trainer, store_fails: str = "", write_after: threading.Event | None = None):
    """What the trainer service does (`weight_send.beside_store`): the send starts with only the version's
    number while the store write runs; the write's outcome (the stored version, or its error) follows.
    With `write_after`, the write waits for that event."""
    stored: Future = Future()
    version = trainer.version + 1
    partial = common_pb2.PolicyVersion(schema_version=common_pb2.SCHEMA_VERSION_1, version=version,
                                       parent_version=version - 1)  # fmt: skip

    def write() -> None:
        if write_after is not None:
            write_after.wait(120)
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


async def test_a_version_sent_again_by_a_restarted_trainer_before_the_first_send_was_confirmed_is_not_served(
    engines, model_dir, store_root, tmp_path, nats_url, redis_url, processes
):
    """A trainer dies after the engines flipped its version 3 in and before its store write ended; its
    successor sends a version 3 of its own. The engines are sent back from the first one, the number
    is not served directly again, and the next version goes straight to both engines as usual."""
    from rlfleet.trainer.service_config import WeightSendConfig
    from rlfleet.trainer.weight_sender import WeightSender

    class DiesBeforeConfirming(WeightSender):
        def _confirm(self, sync_id, stored, summary):
            pass  # the process is gone: no ConfirmTrainerSync

    run = unique_run_id("tsr")
    store = DirectoryWeightStore(store_root, run)
    broker = start_broker(processes, tmp_path, run, store_root, engines, nats_url, redis_url, "p2p",
                          **{"sync.trainer_wait_s": 0.5})
    trainer = await served_from_the_store(engines, broker, store, model_dir, 2)
    config = WeightSendConfig(broker_address=broker.address)
    dead, successor = DiesBeforeConfirming(config), WeightSender(config)
    try:
        partial = common_pb2.PolicyVersion(schema_version=common_pb2.SCHEMA_VERSION_1, version=3,
                                           parent_version=2)
        never: Future = Future()  # the dead trainer's store write never ends
        first = await asyncio.to_thread(dead.send, partial, trainer.model.state_dict(), never)
        assert first.ok and first.awaits_confirm and await _serves(engines, "3"), first
        trainer.step()  # the successor's version 3: other weights
        version, summary = await asyncio.to_thread(send_beside_store, successor, trainer)
        assert version == 3 and all(not o.ok for o in summary.outcomes), summary
        assert not summary.awaits_confirm and not summary.error, summary
        await both_serve(engines, 2, store)  # sent back to the pools' fallback, from the store
        trainer.step()
        version, summary = await asyncio.to_thread(send_beside_store, successor, trainer)
        assert version == 4 and summary.ok and {o.engine_id for o in summary.outcomes} == {"c0", "f0"}
        await both_serve(engines, 4, store)
    finally:
        dead.close()
        successor.close()
    async with open_channel(broker.address) as channel:
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        listed = await stub.ListVersions(broker_pb2.ListVersionsRequest())
    (record,) = [r for r in listed.versions if r.version.version == 3]
    assert record.state == broker_pb2.VERSION_STATE_REJECTED and "sent again" in record.reason, record


async def _serves(engines, label: str) -> bool:
    return all([await weight_version(engines[n].url) == label for n in engines])


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
    assert (not by_engine["c0"].ok and by_engine["c0"].falls_back
            and "connection refused" in by_engine["c0"].message)

    await both_serve(engines, version, store)  # c0 by the store, bit for bit the same
    reported = {e.engine_id: e for e in (await status(broker)).engines}
    assert reported["f0"].last_transport == broker_pb2.TRANSPORT_P2P
    assert reported["c0"].last_transport in (broker_pb2.TRANSPORT_DISK_FULL, broker_pb2.TRANSPORT_DISK_DELTA)


async def test_with_flip_before_stored_the_engines_serve_a_version_while_its_store_write_still_runs(
    engines, model_dir, store_root, tmp_path, nats_url, redis_url, processes
):
    from rlfleet.engine.testing import StoreTrainer
    from rlfleet.trainer.service_config import WeightSendConfig
    from rlfleet.trainer.weight_sender import WeightSender

    run = unique_run_id("tsb4")
    store = DirectoryWeightStore(store_root, run)
    broker = start_broker(processes, tmp_path, run, store_root, engines, nats_url, redis_url, "p2p")
    trainer = StoreTrainer(model_dir, store)
    for _ in range(2):
        trainer.publish()
        trainer.step()
    write_after = threading.Event()
    sender = WeightSender(WeightSendConfig(broker_address=broker.address))
    try:
        sending = asyncio.create_task(asyncio.to_thread(send_beside_store, sender, trainer, "", write_after))

        trainers = to_served(trainer.model.state_dict())

        # by their weights: the engines served a version 3 of another run before
        async def both_on_3() -> bool:
            for name in engines:
                try:
                    await assert_engine_serves(engines[name].url, trainers)
                except AssertionError:
                    return False
            return all([await weight_version(engines[n].url) == "3" for n in engines])

        await eventually(both_on_3, 60.0, message="both engines serve version 3 before it is stored")
        assert store.latest_version() == 2, "the store write has not run yet"
        assert (await status(broker)).canary_version == 3
        write_after.set()
        version, summary = await sending
    finally:
        write_after.set()
        sender.close()
    assert version == 3 and summary.ok and not summary.reverted and summary.serving_s < summary.seconds
    assert {o.engine_id for o in summary.outcomes if o.transport == broker_pb2.TRANSPORT_P2P} == {"c0", "f0"}
    await both_serve(engines, 3, store)  # what they took before the write is the store's version, bit for bit
    async with open_channel(broker.address) as channel:
        listed = await broker_pb2_grpc.BrokerServiceStub(channel).ListVersions(
            broker_pb2.ListVersionsRequest())
    (record,) = [r for r in listed.versions if r.version.version == 3]
    # completed by the confirm
    assert record.state == broker_pb2.VERSION_STATE_ACCEPTED and record.version.uri, record


@pytest.mark.parametrize("flip_before_stored", [False, True])
async def test_a_failed_store_write_beside_the_send_rejects_the_version_and_no_engine_keeps_serving_it(
    engines, model_dir, store_root, tmp_path, nats_url, redis_url, processes, flip_before_stored
):
    from rlfleet.trainer.service_config import WeightSendConfig

    run = unique_run_id("tss")
    store = DirectoryWeightStore(store_root, run)
    broker = start_broker(processes, tmp_path, run, store_root, engines, nats_url, redis_url, "p2p",
                          **{"sync.flip_before_stored": flip_before_stored, "sync.trainer_wait_s": 0.5})
    trainer = await served_from_the_store(engines, broker, store, model_dir, 3)
    before = {n: await weight_version(engines[n].url) for n in engines}
    sender = WeightSendConfig(broker_address=broker.address)
    from rlfleet.trainer.weight_sender import WeightSender

    sender = WeightSender(sender)
    try:
        version, summary = await asyncio.to_thread(send_beside_store, sender, trainer,
                                                   "No space left on device")
    finally:
        sender.close()
    assert version == 4 and store.latest_version() == 3
    assert {o.engine_id for o in summary.outcomes} == {"c0", "f0"}
    assert summary.bytes.get("p2p", 0) > 0
    if flip_before_stored:  # both flipped it in at once, then were sent back to version 3 from the store
        assert all(o.ok for o in summary.outcomes) and sorted(summary.reverted) == ["c0", "f0"], summary
        await both_serve(engines, 3, store)
    else:
        for outcome in summary.outcomes:  # both were written over P2P, and neither flipped it in
            assert (not outcome.ok and "version rejected" in outcome.message
                    and "No space left" in outcome.message)
        assert {n: await weight_version(engines[n].url) for n in engines} == before
    async with open_channel(broker.address) as channel:
        listed = await broker_pb2_grpc.BrokerServiceStub(channel).ListVersions(
            broker_pb2.ListVersionsRequest())
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


async def test_bad_trainer_sync_requests_get_clear_statuses(engines, store_root, tmp_path,
                                                            nats_url, redis_url, processes, model_dir):
    from rlfleet.engine.testing import StoreTrainer

    run = unique_run_id("tsb")
    broker = start_broker(processes, tmp_path, run, store_root, engines, nats_url, redis_url, "p2p")
    manifest = StoreTrainer(model_dir, DirectoryWeightStore(store_root, run)).publish()
    spec = broker_pb2.TensorSpec(name="w", dtype="bfloat16", shape=[2])
    async with open_channel(broker.address) as channel:
        stub = broker_pb2_grpc.BrokerServiceStub(channel)
        for request, words in [
            (broker_pb2.StartTrainerSyncRequest(version=policy_version(manifest),
                                                checksum_algorithm="sha256"),
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
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ConfirmTrainerSync(broker_pb2.ConfirmTrainerSyncRequest(sync_id="nope"))
        assert (err.value.code() == grpc.StatusCode.NOT_FOUND
                and "awaits its store write" in err.value.details())
