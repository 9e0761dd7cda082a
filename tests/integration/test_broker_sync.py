"""The weight broker as a process, with real NATS, Redis, CPU engine processes and a trainer stand-in
(AdamW steps on a tiny model, versions written to a weight store and announced on POLICY).

Every check of weights is bit for bit: each engine's fp32 parameters are read back with
`/get_weights_by_name` and compared with the bf16 bytes the trainer published.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis

from rlfleet.api.broker.v1 import broker_pb2, broker_pb2_grpc
from rlfleet.broker.registry import VersionRegistry
from rlfleet.broker.testing import BrokerProcess, policy_version
from rlfleet.common.config import NatsConfig
from rlfleet.common.grpc_server import channel as open_channel
from rlfleet.common.processes import ServiceProcess, eventually
from rlfleet.common.streams import connect_nats, publish
from rlfleet.common.testing import unique_run_id
from rlfleet.engine.testing import EngineProcess, StoreTrainer, assert_engine_serves, build_tiny_model
from rlfleet.engine.testing import http_call as call
from rlfleet.weights import DirectoryWeightStore

pytestmark = [pytest.mark.integration, pytest.mark.slow]

State = broker_pb2.VersionState


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import torch

    torch.set_num_threads(1)
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=1)


def engine_list(engines, kinds=None, **pools):
    kinds = kinds or {}
    return [{"engine_id": name, "url": engines[name].url, "pool": pools.get(name, "fleet"),
             "kind": kinds.get(name, "cpu")} for name in pools]


class Run:
    """One test's run: its trainer, store run directory, POLICY subject, broker and stub."""

    def __init__(self, model_dir, store_root, tmp_path, nats_url, redis_url):
        self.run_id = unique_run_id("b")
        self.trainer = StoreTrainer(model_dir, DirectoryWeightStore(store_root, self.run_id, full_every=100))
        self.tmp_path, self.nats_url, self.redis_url, self.store_root = (tmp_path, nats_url, redis_url,
                                                                         store_root)
        self.broker: BrokerProcess | None = None
        self.nc = None

    def start_broker(self, **settings) -> BrokerProcess:
        self.broker = BrokerProcess(
            self.tmp_path / "broker", run_id=self.run_id, weight_store=str(self.store_root),
            **{"nats.url": self.nats_url, "redis.url": self.redis_url}, **settings,
        ).start()  # fmt: skip
        self.channel = open_channel(self.broker.address)
        self.stub = broker_pb2_grpc.BrokerServiceStub(self.channel)
        return self.broker

    async def announce(self, kind: str | None = None) -> int:
        """The trainer takes a step (after the first version), writes a version and announces it on POLICY."""
        if self.trainer.version:
            self.trainer.step()
        manifest = self.trainer.publish(kind)
        if self.nc is None:
            self.nc = await connect_nats(NatsConfig(url=self.nats_url), "test-trainer")
        payload = policy_version(manifest).SerializeToString()
        await publish(self.nc.jetstream(), "POLICY", self.run_id, payload, msg_type="PolicyVersion",
                      msg_id=f"{self.run_id}-v{manifest['version']}")  # fmt: skip
        return manifest["version"]

    async def listed(self, version: int) -> broker_pb2.VersionRecord | None:
        """The broker's record of `version`, or None while it has not seen the announcement yet."""
        for record in (await self.stub.ListVersions(broker_pb2.ListVersionsRequest())).versions:
            if record.version.version == version:
                return record
        return None

    async def record(self, version: int) -> broker_pb2.VersionRecord:
        record = await self.listed(version)
        if record is None:
            raise AssertionError(f"version {version} not listed")
        return record

    async def close(self) -> None:
        if self.nc is not None:
            await self.nc.close()
        if self.broker is not None:
            await self.channel.close()
            self.broker.stop()


@pytest.fixture
async def run(model_dir, store_root, tmp_path, nats_url, redis_url):
    run = Run(model_dir, store_root, tmp_path, nats_url, redis_url)
    yield run
    await run.close()


async def held(url: str) -> tuple[str, str | None]:
    _, info = await call(url, "/model_info", method="GET")
    return info["weight_version"], info["weight_store_path"]


async def serves(run: Run, url: str, version: int) -> bool:
    weight_version, path = await held(url)
    return weight_version == str(version) and path == str(run.trainer.store.path(version))


async def all_serve(run: Run, engines, names, version: int, within_s: float = 20.0) -> None:
    async def check():
        return all([await serves(run, engines[n].url, version) for n in names])

    await eventually(check, within_s, message=f"{names} serve version {version}")
    for name in names:
        await assert_engine_serves(engines[name].url, run.trainer.served(version))


async def generated_version(url: str) -> str:
    _, out = await call(url, "/generate",
                        {"input_ids": [1, 11, 12], "sampling_params": {"max_new_tokens": 2}})
    return out["meta_info"]["weight_version"]


async def test_canary_engines_serve_a_new_version_while_the_fleet_serves_the_accepted_one_until_promotion(
    run, engines
):
    run.start_broker(engines=engine_list(engines, c0="canary", f0="fleet"))
    v1 = await run.announce()
    await all_serve(run, engines, ["c0"], v1)
    assert (await run.record(v1)).state == State.VERSION_STATE_CANARY
    assert not await serves(run, engines["f0"].url, v1)  # the fleet has no accepted version yet
    assert ((await run.stub.Promote(broker_pb2.PromoteRequest(version=v1, reason="gate: ok")))
            .accepted_version == v1)
    await all_serve(run, engines, ["c0", "f0"], v1)

    v2 = await run.announce()  # a delta
    assert run.trainer.store.index(v2).kind == "delta"
    await all_serve(run, engines, ["c0"], v2)
    await asyncio.sleep(1.2)  # two reconcile rounds: the fleet must stay on the accepted version
    assert await serves(run, engines["f0"].url, v1)
    assert await generated_version(engines["f0"].url) == str(v1)
    assert await generated_version(engines["c0"].url) == str(v2)
    status = await run.stub.GetStatus(broker_pb2.GetStatusRequest())
    assert (status.canary_version, status.accepted_version, status.latest_version) == (v2, v1, v2)

    await run.stub.Promote(broker_pb2.PromoteRequest(version=v2, reason="gate: ok"))
    await all_serve(run, engines, ["c0", "f0"], v2)
    record = await run.record(v2)
    assert record.state == State.VERSION_STATE_ACCEPTED and record.reason == "gate: ok"
    assert record.canary_unix_ms and record.accepted_unix_ms >= record.canary_unix_ms

    async def fleet_serving_recorded():
        return (await run.record(v2)).fleet_serving_unix_ms

    await eventually(fleet_serving_recorded)
    status = await run.stub.GetStatus(broker_pb2.GetStatusRequest())
    for engine in status.engines:
        assert engine.policy_version == v2 and engine.state == "serving", engine
        assert engine.last_transport == broker_pb2.TRANSPORT_DISK_DELTA and engine.fallbacks == 0, engine
        assert 0 < engine.last_pause_s < 1.0 and engine.last_bytes > 0, engine
    _, metrics = await call(f"http://127.0.0.1:{run.broker.metrics_port}", "/metrics", method="GET")
    for name in ("rlfleet_broker_pause_seconds", "rlfleet_broker_update_bytes",
                 "rlfleet_broker_changed_ratio", "rlfleet_broker_publish_to_serving_seconds",
                 "rlfleet_broker_updates_total"):
        assert name in metrics, name
    assert 'transport="disk_delta"' in metrics and 'transport="disk_full"' in metrics


async def test_the_candidate_pool_holds_the_pinned_version_while_the_canary_moves_on(run, engines, redis_url):
    """The gate's candidate stays put on the candidate pool while rollouts (the canary) take every new
    version; a rollback clears the pin, and the pool goes back to the accepted version."""
    run.start_broker(engines=engine_list(engines, c0="canary", f0="candidate"))
    v1 = await run.announce()
    await all_serve(run, engines, ["c0"], v1)
    assert (await run.stub.Promote(broker_pb2.PromoteRequest(version=v1))).accepted_version == v1
    await all_serve(run, engines, ["f0"], v1)  # unpinned: the accepted version

    v2 = await run.announce()
    await all_serve(run, engines, ["c0"], v2)
    reply = await run.stub.PinCandidate(broker_pb2.PinCandidateRequest(version=v2, reason="gate"))
    assert reply.candidate_version == v2
    await all_serve(run, engines, ["f0"], v2)
    for _ in range(2):
        newest = await run.announce()
    await all_serve(run, engines, ["c0"], newest)
    await asyncio.sleep(1.2)  # two reconcile rounds: the candidate must stay pinned
    assert await generated_version(engines["f0"].url) == str(v2)
    status = await run.stub.GetStatus(broker_pb2.GetStatusRequest())
    assert (status.candidate_version, status.canary_version, status.accepted_version) == (v2, newest, v1)
    assert {e.engine_id: e.pool for e in status.engines} == {"c0": "canary", "f0": "candidate"}

    # A version the canary reached while the next was announced was marked SKIPPED (superseded) as
    # it loaded: the canary serves it, so the next round makes it CANARY again (and pinnable).
    await set_registry_state(redis_url, run.run_id, newest, State.VERSION_STATE_SKIPPED)

    async def served_again():
        return (await run.record(newest)).state == State.VERSION_STATE_CANARY

    await eventually(served_again, 10.0)
    await run.stub.PinCandidate(broker_pb2.PinCandidateRequest(version=newest))
    await all_serve(run, engines, ["f0"], newest)

    # One no engine serves stays SKIPPED: not a candidate; nor is an unknown one.
    await set_registry_state(redis_url, run.run_id, v2 + 1, State.VERSION_STATE_SKIPPED)
    for version, code in ((v2 + 1, grpc.StatusCode.FAILED_PRECONDITION), (99, grpc.StatusCode.NOT_FOUND)):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await run.stub.PinCandidate(broker_pb2.PinCandidateRequest(version=version))
        assert err.value.code() == code, err.value.details()

    await run.stub.Promote(broker_pb2.PromoteRequest(version=newest))
    assert (await run.stub.Rollback(broker_pb2.RollbackRequest(reason="bad"))).accepted_version == v1
    await all_serve(run, engines, ["c0", "f0"], v1)
    assert (await run.stub.GetStatus(broker_pb2.GetStatusRequest())).candidate_version == -1


async def set_registry_state(redis_url: str, run_id: str, version: int, state) -> None:
    """Sets a version's state in the broker's registry, as the broker itself would."""
    registry = VersionRegistry(aioredis.from_url(redis_url), run_id)
    try:
        await registry.set_state(await registry.require(version), state, "passed over by the sync policy")
    finally:
        await registry.redis.aclose()


async def test_rollback_restores_the_previous_accepted_version_everywhere(run, engines):
    run.start_broker(engines=engine_list(engines, c0="canary", f0="fleet"))
    names = ["c0", "f0"]
    for _ in range(2):
        version = await run.announce()
        await all_serve(run, engines, ["c0"], version)
        await run.stub.Promote(broker_pb2.PromoteRequest(version=version))
        await all_serve(run, engines, names, version)
    v3 = await run.announce()
    await all_serve(run, engines, ["c0"], v3)

    # The canary's version goes: back to the accepted one, and it is rejected.
    reply = await run.stub.Rollback(broker_pb2.RollbackRequest(reason="gate: reward regressed"))
    assert reply.accepted_version == 2
    await all_serve(run, engines, names, 2)
    assert (await run.record(v3)).state == State.VERSION_STATE_REJECTED
    # Then the accepted one goes too: everything back to version 1.
    assert (await run.stub.Rollback(broker_pb2.RollbackRequest(reason="bad"))).accepted_version == 1
    await all_serve(run, engines, names, 1)
    record = await run.record(2)
    assert record.state == State.VERSION_STATE_ROLLED_BACK and record.reason == "bad"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await run.stub.Rollback(broker_pb2.RollbackRequest())
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await run.stub.Rollback(broker_pb2.RollbackRequest(to_version=2))  # rolled back: not accepted
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # New versions still flow after a rollback.
    v4 = await run.announce()
    await all_serve(run, engines, ["c0"], v4)


async def test_a_corrupt_delta_is_refused_nothing_changes_and_the_next_full_version_recovers(run, engines):
    run.start_broker(engines=engine_list(engines, c0="canary", f0="fleet"), auto_promote=True)
    names = ["c0", "f0"]
    v1 = await run.announce()
    await all_serve(run, engines, names, v1)
    # The trainer writes v2, and its delta is damaged in the store before anyone reads it.
    run.trainer.step()
    manifest = run.trainer.publish()
    payload = run.trainer.store.path(manifest["version"]) / "delta.safetensors"
    data = bytearray(payload.read_bytes())
    for offset in range(len(data) - 300, len(data) - 8, 5):
        data[offset] ^= 0xA5
    payload.write_bytes(bytes(data))
    nc = await connect_nats(NatsConfig(url=run.nats_url), "test-trainer")
    await publish(nc.jetstream(), "POLICY", run.run_id, policy_version(manifest).SerializeToString(),
                  msg_type="PolicyVersion")  # fmt: skip
    await nc.close()

    async def rejected():
        record = await run.listed(2)  # the announcement may not have reached the broker yet
        return record is not None and record.state == State.VERSION_STATE_REJECTED

    await eventually(rejected, message="version 2 rejected")
    assert "cannot load it" in (await run.record(2)).reason
    status = await run.stub.GetStatus(broker_pb2.GetStatusRequest())
    canary = next(e for e in status.engines if e.engine_id == "c0")
    assert canary.fallbacks == 1 and "cannot be rebuilt exactly" in canary.last_error
    assert status.canary_version == v1 and status.accepted_version == v1
    for name in names:  # never a half-applied version
        assert await serves(run, engines[name].url, v1)
        await assert_engine_serves(engines[name].url, run.trainer.served(v1))
    # The trainer's next full checkpoint brings every engine to its weights.
    v3 = await run.announce(kind="full")
    await all_serve(run, engines, names, v3)


async def test_an_engine_not_holding_a_deltas_base_falls_back_to_a_full_load(
        run, engines, model_dir, store_root):
    # Rounds only when something happens, so that nothing repairs the engine before v2 arrives.
    run.start_broker(engines=engine_list(engines, f0="fleet"), auto_promote=True, reconcile_interval_s=60)
    v1 = await run.announce()
    await all_serve(run, engines, ["f0"], v1)
    # Behind the broker's back the engine gets other weights but keeps the label of version 1.
    # (From under the engine's weight store root: it loads from nowhere else.)
    plain = shutil.copytree(model_dir, Path(store_root) / "behind-the-brokers-back", dirs_exist_ok=True)
    body = {"model_path": str(plain), "weight_version": str(v1)}
    assert (await call(engines["f0"].url, "/update_weights_from_disk", body))[0] == 200
    v2 = await run.announce()
    await all_serve(run, engines, ["f0"], v2)
    status = await run.stub.GetStatus(broker_pb2.GetStatusRequest())
    (engine,) = status.engines
    assert engine.fallbacks == 1 and engine.last_transport == broker_pb2.TRANSPORT_DISK_FULL


async def test_the_distributed_transport_gives_engines_the_trainers_weights_bit_for_bit(
        run, engines, monkeypatch):
    from rlfleet.broker.distributed_sender import send_version

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    run.start_broker(engines=engine_list(engines, c0="canary", f0="fleet"), auto_promote=True,
                     **{"sync.transport": "distributed"})  # fmt: skip
    names = ["c0", "f0"]
    for _ in range(3):
        if run.trainer.version:
            run.trainer.step()
        manifest = run.trainer.publish()  # the store keeps every version for engines that miss a broadcast
        result = await asyncio.to_thread(
            send_version, run.broker.address, policy_version(manifest), run.trainer.model.state_dict(),
            master_address="127.0.0.1", timeout_s=60.0,
        )  # fmt: skip
        assert sorted(result.engine_ids) == names and result.sent_bytes > 0, result
        version = manifest["version"]

        async def received(version=version):
            return all([(await held(engines[n].url))[0] == str(version) for n in names])

        await eventually(received)
        for name in names:
            await assert_engine_serves(engines[name].url, run.trainer.served(version))
    status = await run.stub.GetStatus(broker_pb2.GetStatusRequest())
    assert all(e.last_transport == broker_pb2.TRANSPORT_DISTRIBUTED and e.policy_version == version
               for e in status.engines), status  # fmt: skip
    assert (await run.record(version)).state == State.VERSION_STATE_ACCEPTED


async def test_a_new_engine_registered_draining_gets_the_accepted_version_before_it_takes_traffic(
    run, engines, tmp_path
):
    """Against the real rollout gateway: engines come from its ListEngines, a new one registers with
    start_draining, the broker brings it to the accepted version (a full load, paused through the
    gateway's PauseEngines) and then asks the gateway to put it back in traffic."""
    from rlfleet.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc

    gateway = ServiceProcess("rlfleet-gateway", tmp_path / "gateway", config={
        "run_id": run.run_id, "redis.url": run.redis_url, "health_interval_s": 0.3,
        "log.format": "text"}).start()
    channel = open_channel(gateway.address)
    try:
        gw = gateway_pb2_grpc.GatewayServiceStub(channel)
        await gw.RegisterEngine(gateway_pb2.RegisterEngineRequest(
            engine_id="c0", url=engines["c0"].url, pool=gateway_pb2.ENGINE_POOL_CANARY,
            kind=gateway_pb2.ENGINE_KIND_CPU))  # fmt: skip
        run.start_broker(gateway_address=gateway.address, auto_promote=True)
        v1 = await run.announce()
        await all_serve(run, engines, ["c0"], v1)

        async def accepted():
            return (await run.record(v1)).state == State.VERSION_STATE_ACCEPTED

        await eventually(accepted)
        await gw.RegisterEngine(gateway_pb2.RegisterEngineRequest(
            engine_id="f0", url=engines["f0"].url, pool=gateway_pb2.ENGINE_POOL_FLEET,
            kind=gateway_pb2.ENGINE_KIND_CPU, start_draining=True))  # fmt: skip
        await all_serve(run, engines, ["f0"], v1)
        _, load = await call(engines["f0"].url, "/server_info", method="GET")
        assert load["paused"] is None  # resumed after the full load

        async def state_of_f0():
            listed = await gw.ListEngines(gateway_pb2.ListEnginesRequest())
            return next(e.state for e in listed.engines if e.engine_id == "f0")

        try:
            await gw.UpdateEngineState(gateway_pb2.UpdateEngineStateRequest(engine_id="nobody"))
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                assert await state_of_f0() == gateway_pb2.ENGINE_STATE_DRAINING
                pytest.xfail("the gateway does not implement UpdateEngineState yet: f0 stays DRAINING")

        async def back_in_traffic():
            return await state_of_f0() == gateway_pb2.ENGINE_STATE_HEALTHY

        await eventually(back_in_traffic, message="f0 HEALTHY")
    finally:
        await channel.close()
        gateway.stop()


async def test_an_engine_that_was_down_during_a_sync_catches_up_when_it_returns(
    run, engines, model_dir, tmp_path
):
    run.start_broker(engines=engine_list(engines, c0="canary", f0="fleet"), auto_promote=True)
    v1 = await run.announce()
    await all_serve(run, engines, ["c0", "f0"], v1)
    port = engines["f0"].port
    engines["f0"].stop()
    v2 = await run.announce()
    await all_serve(run, engines, ["c0"], v2)

    async def reported_down():
        status = await run.stub.GetStatus(broker_pb2.GetStatusRequest())
        return any(e.engine_id == "f0" and e.state == "down" for e in status.engines)

    await eventually(reported_down)
    assert (await run.record(v2)).state == State.VERSION_STATE_ACCEPTED
    assert not (await run.record(v2)).fleet_serving_unix_ms
    # It comes back (same address) with its base weights, and the reconcile loop catches it up.
    engines["f0"] = EngineProcess(model_dir, tmp_path / "f0", weight_store_root=run.store_root, port=port,
                                  engine_id="f0").start()  # fmt: skip
    await all_serve(run, engines, ["f0"], v2)
    assert (await run.record(v2)).fleet_serving_unix_ms > 0
