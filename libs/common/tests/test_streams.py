"""JetStream helpers against a real nats-server: idempotent streams, durable consumers, dedup, run
isolation."""

import pytest

from rlfleet.api.common.v1 import common_pb2
from rlfleet.common.config import NatsConfig, RedisConfig
from rlfleet.common.errors import InvalidArgument, StartupError
from rlfleet.common.redis_store import connect_redis, key
from rlfleet.common.streams import (
    SCHEMA_HEADER,
    connect_nats,
    durable_name,
    ensure_consumer,
    ensure_streams,
    publish,
    subject,
)
from rlfleet.common.testing import unique_run_id

pytestmark = pytest.mark.integration


async def test_streams_and_consumers_can_be_ensured_twice(nats_url):
    nc = await connect_nats(NatsConfig(url=nats_url), "t")
    js = nc.jetstream()
    await ensure_streams(js)
    await ensure_streams(js)
    run = unique_run_id()
    await ensure_consumer(js, "TRAJECTORIES", durable_name("trainer", run), run)
    await ensure_consumer(js, "TRAJECTORIES", durable_name("trainer", run), run)
    names = {s.config.name for s in await js.streams_info()}
    assert {"TASKS", "TRAJECTORIES", "POLICY"} <= names
    await nc.close()


async def test_a_published_trajectory_is_consumed_once_with_explicit_ack_and_a_retry_is_deduplicated(
        nats_url):
    nc = await connect_nats(NatsConfig(url=nats_url), "t")
    js = nc.jetstream()
    await ensure_streams(js)
    run = unique_run_id()
    durable = durable_name("trainer", run)
    await ensure_consumer(js, "TRAJECTORIES", durable, run)
    traj = common_pb2.Trajectory(schema_version=1, trajectory_id="tr-1", run_id=run, token_ids=[5, 6, 7])
    assert await publish(js, "TRAJECTORIES", run, traj.SerializeToString(),
                         msg_type="Trajectory", msg_id="tr-1")
    assert not await publish(js, "TRAJECTORIES", run, traj.SerializeToString(),
                             msg_type="Trajectory", msg_id="tr-1")
    sub = await js.pull_subscribe_bind(durable, "TRAJECTORIES")
    msgs = await sub.fetch(10, timeout=2)
    assert len(msgs) == 1
    assert msgs[0].headers[SCHEMA_HEADER] == "1"
    assert common_pb2.Trajectory.FromString(msgs[0].data).token_ids == [5, 6, 7]
    await msgs[0].ack()
    with pytest.raises(TimeoutError):  # nothing else is pending (nats' TimeoutError is one)
        await sub.fetch(1, timeout=0.5)
    await nc.close()


async def test_runs_never_see_each_others_messages(nats_url):
    nc = await connect_nats(NatsConfig(url=nats_url), "t")
    js = nc.jetstream()
    await ensure_streams(js)
    run_a, run_b = unique_run_id("a"), unique_run_id("b")
    assert subject("TASKS", run_a) != subject("TASKS", run_b)
    for run in (run_a, run_b):
        await ensure_consumer(js, "TASKS", durable_name("worker", run), run)
    await publish(js, "TASKS", run_a, b"task-for-a", msg_type="Task")
    sub_b = await js.pull_subscribe_bind(durable_name("worker", run_b), "TASKS")
    with pytest.raises(TimeoutError):
        await sub_b.fetch(1, timeout=0.5)
    sub_a = await js.pull_subscribe_bind(durable_name("worker", run_a), "TASKS")
    (msg,) = await sub_a.fetch(1, timeout=2)
    assert msg.data == b"task-for-a"
    await msg.ack()
    await nc.close()


async def test_an_oversized_message_is_refused_with_a_clear_error(nats_url):
    nc = await connect_nats(NatsConfig(url=nats_url), "t")
    js = nc.jetstream()
    with pytest.raises(InvalidArgument, match="exceeds the POLICY limit"):
        await publish(js, "POLICY", "r", b"x" * (9 << 20), msg_type="PolicyVersion")
    await nc.close()


async def test_unreachable_nats_or_redis_is_a_one_line_startup_error():
    with pytest.raises(StartupError, match="cannot reach NATS at nats://127.0.0.1:1"):
        await connect_nats(NatsConfig(url="nats://127.0.0.1:1", connect_timeout_s=1), "t")
    with pytest.raises(StartupError, match="cannot reach Redis"):
        await connect_redis(RedisConfig(url="redis://127.0.0.1:1/0", connect_timeout_s=1))


async def test_redis_round_trip_with_run_namespaced_keys(redis_url):
    client = await connect_redis(RedisConfig(url=redis_url))
    name = key(unique_run_id(), "sessions", "s1")
    assert name.startswith("rlfleet:")
    await client.set(name, b"state", ex=10)
    assert await client.get(name) == b"state"
    await client.aclose()
