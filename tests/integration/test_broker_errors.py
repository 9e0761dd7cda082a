"""The weight broker's answers to bad input, as a process over gRPC: NOT_FOUND for unknown versions,
FAILED_PRECONDITION for promotions and rollbacks that cannot be, INVALID_ARGUMENT for announcements
outside the weight store or of another run; a POLICY message it cannot read is dropped, not retried."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from rlfleet.api.broker.v1 import broker_pb2, broker_pb2_grpc
from rlfleet.broker.testing import BrokerProcess, policy_version
from rlfleet.common.config import NatsConfig
from rlfleet.common.grpc_server import channel as open_channel
from rlfleet.common.processes import eventually
from rlfleet.common.streams import connect_nats, publish
from rlfleet.common.testing import unique_run_id
from rlfleet.weights import DirectoryWeightStore

pytestmark = pytest.mark.integration


@pytest.fixture
async def broker(tmp_path, nats_url, redis_url):
    """A broker with no engines, and a store holding versions 1 (full) and 2 (delta) of its run."""
    run_id = unique_run_id("e")
    store = DirectoryWeightStore(tmp_path / "weights", run_id)
    rng = np.random.default_rng(0)
    weights = {"w": rng.standard_normal((64, 64)).astype(np.float32)}
    manifests = [store.write_version(1, weights)]
    weights["w"][:4] += 0.5
    manifests.append(store.write_version(2, weights))
    process = BrokerProcess(tmp_path / "broker", run_id=run_id, weight_store=str(tmp_path / "weights"),
                            **{"nats.url": nats_url, "redis.url": redis_url}).start()  # fmt: skip
    channel = open_channel(process.address)
    yield broker_pb2_grpc.BrokerServiceStub(channel), manifests, process, run_id
    await channel.close()
    process.stop()


async def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code(), err.value.details() or ""


async def test_unknown_versions_are_not_found(broker):
    stub, manifests, _, _ = broker
    assert ((await code_of(stub.Promote(broker_pb2.PromoteRequest(version=99))))[0]
            == grpc.StatusCode.NOT_FOUND)
    code, _ = await code_of(stub.Rollback(broker_pb2.RollbackRequest(to_version=99)))
    assert code == grpc.StatusCode.NOT_FOUND
    missing = policy_version({**manifests[1], "version": 7,
                              "uri": manifests[1]["uri"].replace("v000002", "v000007")})
    code, details = await code_of(stub.PublishVersion(missing))
    assert code == grpc.StatusCode.NOT_FOUND and "not in the weight store" in details


async def test_announcements_outside_the_store_or_of_another_run_are_invalid_arguments(broker, tmp_path):
    stub, manifests, _, _ = broker
    outside = policy_version({**manifests[0], "uri": (tmp_path / "elsewhere" / "v000001").as_uri()})
    code, details = await code_of(stub.PublishVersion(outside))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "outside the weight store" in details
    dotdot = policy_version({**manifests[0], "uri": manifests[0]["path"] + "/../../../v000001"})
    assert (await code_of(stub.PublishVersion(dotdot)))[0] == grpc.StatusCode.INVALID_ARGUMENT
    other_run = policy_version({**manifests[0], "run_id": "someone-else"})
    code, details = await code_of(stub.PublishVersion(other_run))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "someone-else" in details
    unversioned = policy_version(manifests[0])
    unversioned.schema_version = 0
    assert (await code_of(stub.PublishVersion(unversioned)))[0] == grpc.StatusCode.INVALID_ARGUMENT


async def test_promoting_a_version_the_canary_never_served_and_rolling_back_with_nothing_accepted_fail(
        broker):
    stub, manifests, _, _ = broker
    reply = await stub.PublishVersion(policy_version(manifests[0]))
    assert reply.state == broker_pb2.VERSION_STATE_ANNOUNCED  # no canary engine will ever serve it
    code, details = await code_of(stub.Promote(broker_pb2.PromoteRequest(version=1)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "canary" in details
    code, details = await code_of(stub.Rollback(broker_pb2.RollbackRequest()))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "nothing accepted" in details
    code, _ = await code_of(stub.Rollback(broker_pb2.RollbackRequest(to_version=1)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    status = await stub.GetStatus(broker_pb2.GetStatusRequest())
    assert (status.latest_version, status.canary_version, status.accepted_version) == (1, 1, -1)
    # Announcing again is idempotent.
    assert ((await stub.PublishVersion(policy_version(manifests[0]))).state
            == broker_pb2.VERSION_STATE_ANNOUNCED)


async def test_a_policy_message_the_broker_cannot_read_is_dropped_and_the_next_one_is_taken(broker, nats_url):
    stub, manifests, process, run_id = broker
    nc = await connect_nats(NatsConfig(url=nats_url), "test")
    try:
        js = nc.jetstream()
        await publish(js, "POLICY", run_id, b"\xff\x00not a protobuf", msg_type="PolicyVersion")
        await publish(js, "POLICY", run_id, policy_version(manifests[0]).SerializeToString(),
                      msg_type="PolicyVersion")
    finally:
        await nc.close()

    async def announced():
        return (await stub.ListVersions(broker_pb2.ListVersionsRequest())).versions

    (record,) = await eventually(announced)
    assert record.version.version == 1 and record.state == broker_pb2.VERSION_STATE_ANNOUNCED
    assert "dropping" in process.log()
