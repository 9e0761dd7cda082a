"""NATS users with per-subject permissions and Redis ACL users, against the secured servers the
harness starts (the same config `rlfleet up` starts them with)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import stat

import pytest
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, AuthorizationError, NoPermissionError
from redis.exceptions import ConnectionError as RedisConnectionError

from rlfleet.common import revocations
from rlfleet.common.config import NatsConfig, RedisConfig
from rlfleet.common.errors import StartupError
from rlfleet.common.infra_auth import (
    NATS_ROLES,
    REDIS_ROLES,
    RUN_STATE_BUCKET,
    ensure_infra_secrets,
    nats_permissions,
    redis_acl,
)
from rlfleet.common.redis_store import RetryNotRefusals, connect_redis, key
from rlfleet.common.streams import connect_nats, ensure_streams, publish, subject
from rlfleet.common.testing import unique_run_id, without_login


def nats_as(nats_url: str, infra_secrets, user: str) -> NatsConfig:
    return NatsConfig(url=without_login(nats_url), **infra_secrets.nats[user].nats())


def redis_as(redis_url: str, infra_secrets, user: str) -> RedisConfig:
    return RedisConfig(url=without_login(redis_url), **infra_secrets.redis[user].redis())


async def trajectory_count(nats_url: str, run_id: str) -> int:
    nc = await connect_nats(NatsConfig(url=nats_url), "t-count")
    try:
        info = await nc.jetstream().stream_info("TRAJECTORIES",
                                                subjects_filter=subject("TRAJECTORIES", run_id))
        return sum((info.state.subjects or {}).values())
    finally:
        await nc.close()


async def test_secrets_are_private_and_kept(tmp_path):
    first = ensure_infra_secrets(tmp_path / "secrets")
    again = ensure_infra_secrets(tmp_path / "secrets")
    assert set(first.nats) == set(NATS_ROLES) and set(first.redis) == set(REDIS_ROLES)
    for credential in (*first.nats.values(), *first.redis.values()):
        assert stat.S_IMODE(credential.password_file.stat().st_mode) == 0o600
        assert len(credential.password) >= 32
    assert stat.S_IMODE((tmp_path / "secrets").stat().st_mode) == 0o700
    assert [c.password for c in again.nats.values()] == [c.password for c in first.nats.values()]
    assert first.nats["trainer"].password != first.nats["worker"].password
    acl = redis_acl(first)
    assert "user default off" in acl and first.redis["verifier"].password not in acl  # hashed only


async def test_nats_without_a_login_is_refused(nats_url):
    with pytest.raises(StartupError, match="(?i)authorization"):
        await connect_nats(NatsConfig(url=without_login(nats_url), connect_timeout_s=2), "t-anon")


async def test_nats_with_a_wrong_password_is_refused(nats_url):
    config = NatsConfig(url=without_login(nats_url), user="trainer", password="wrong", connect_timeout_s=2)
    # The server answers -ERR 'Authorization Violation' and closes; on a loaded host the close can
    # reach the client first, as a reset. Either way the login is refused, never taken.
    with pytest.raises(StartupError, match="(?i)authorization|connection reset"):
        await connect_nats(config, "t-wrong")


@pytest.mark.parametrize("user", ["worker", "trainer", "weight-broker", "operator"])
async def test_only_the_session_server_may_publish_a_trajectory(nats_url, infra_secrets, user, caplog):
    run_id = unique_run_id("auth")
    owner = await connect_nats(nats_as(nats_url, infra_secrets, "session-server"), "t-owner")
    await ensure_streams(owner.jetstream())
    intruder = await connect_nats(nats_as(nats_url, infra_secrets, user), "t-intruder")
    try:
        with caplog.at_level(logging.WARNING, "rlfleet.nats"), pytest.raises(TimeoutError):
            await publish(intruder.jetstream(), "TRAJECTORIES", run_id, b"forged", msg_type="Trajectory",
                          timeout_s=1.0)
        await intruder.publish(subject("TRAJECTORIES", run_id), b"forged")  # plain NATS, no ack wanted
        await intruder.flush()
        await asyncio.sleep(0.2)
        assert "permissions violation for publish" in caplog.text.lower()
        assert await trajectory_count(nats_url, run_id) == 0
        # the session server's own publish goes through: the refusal is about who, not what
        assert await publish(owner.jetstream(), "TRAJECTORIES", run_id, b"real", msg_type="Trajectory")
        assert await trajectory_count(nats_url, run_id) == 1
    finally:
        await intruder.close()
        await owner.close()


async def test_only_the_trainer_may_publish_a_policy_version(nats_url, infra_secrets):
    run_id = unique_run_id("auth")
    session = await connect_nats(nats_as(nats_url, infra_secrets, "session-server"), "t-session")
    trainer = await connect_nats(nats_as(nats_url, infra_secrets, "trainer"), "t-trainer")
    try:
        with pytest.raises(TimeoutError):
            await publish(session.jetstream(), "POLICY", run_id, b"v9", msg_type="PolicyVersion",
                          timeout_s=1.0)
        assert await publish(trainer.jetstream(), "POLICY", run_id, b"v1", msg_type="PolicyVersion")
    finally:
        await session.close()
        await trainer.close()


@pytest.mark.parametrize("user", ["operator", "worker", "trainer", "session-server", "weight-broker"])
async def test_only_the_controller_may_write_or_read_the_run_state(nats_url, infra_secrets, user, caplog):
    """The run's state (JetStream KV RLFLEET_RUNS, rlfleet.controller.state_store) is the controller's
    alone: another user can neither forge it (a second driver's tasks) nor read it."""
    from nats.js.api import KeyValueConfig, StorageType
    from nats.js.errors import BucketNotFoundError
    from nats.js.kv import KeyValue

    run_id = unique_run_id("auth")
    key = f"{run_id}.head"
    controller = await connect_nats(nats_as(nats_url, infra_secrets, "controller"), "t-controller")
    intruder = await connect_nats(nats_as(nats_url, infra_secrets, user), "t-intruder")
    try:
        try:
            mine = await controller.jetstream().key_value(RUN_STATE_BUCKET)
        except BucketNotFoundError:  # as the controller's store makes it
            mine = await controller.jetstream().create_key_value(KeyValueConfig(
                bucket=RUN_STATE_BUCKET, history=1, storage=StorageType.FILE, direct=True))
        await mine.create(key, b"the controller's")
        # The intruder binds the bucket by hand (stream info is everyone's) and tries what the store does.
        theirs = KeyValue(name=RUN_STATE_BUCKET, stream=f"KV_{RUN_STATE_BUCKET}",
                          pre=f"$KV.{RUN_STATE_BUCKET}.", js=intruder.jetstream(timeout=1.0), direct=True)
        with caplog.at_level(logging.WARNING, "rlfleet.nats"):
            with pytest.raises(TimeoutError):
                await theirs.put(key, b"forged")
            with pytest.raises(TimeoutError):
                await theirs.purge(key)
            with pytest.raises(TimeoutError):
                await theirs.get(key)
            with pytest.raises(TimeoutError):
                await intruder.jetstream(timeout=1.0).create_key_value(KeyValueConfig(bucket="RLFLEET_RUNS2"))
        assert "permissions violation for publish" in caplog.text.lower()
        assert (await mine.get(key)).value == b"the controller's"
    finally:
        await intruder.close()
        await controller.close()


def test_the_controller_may_touch_only_its_runs_state_keys():
    allowed = nats_permissions("controller", "r1")["publish"]["allow"]
    assert [s for s in allowed if RUN_STATE_BUCKET in s] == [
        f"$JS.API.DIRECT.GET.KV_{RUN_STATE_BUCKET}.$KV.{RUN_STATE_BUCKET}.r1.>",
        f"$JS.API.STREAM.CREATE.KV_{RUN_STATE_BUCKET}", f"$KV.{RUN_STATE_BUCKET}.r1.>"]
    for role in NATS_ROLES:
        if role != "controller":
            allowed = nats_permissions(role, "r1")["publish"]["allow"]
            assert not [s for s in allowed if RUN_STATE_BUCKET in s], role


async def test_a_consumer_cannot_rewrite_a_stream_it_does_not_publish(nats_url, infra_secrets):
    """A stream update could add a source with a subject transform: another way to publish into it."""
    worker = await connect_nats(nats_as(nats_url, infra_secrets, "worker"), "t-worker")
    try:
        js = worker.jetstream(timeout=1.0)
        await ensure_streams(js)  # every process does this at start: creating or checking is allowed
        config = (await js.stream_info("TRAJECTORIES")).config
        with pytest.raises(TimeoutError):
            await js.update_stream(dataclasses.replace(config, max_age=1.0))
        assert (await js.stream_info("TRAJECTORIES")).config.max_age == config.max_age
    finally:
        await worker.close()


async def test_a_worker_cannot_read_trajectories(nats_url, infra_secrets):
    run_id = unique_run_id("auth")
    seen = []
    worker = await connect_nats(nats_as(nats_url, infra_secrets, "worker"), "t-worker")
    harness = await connect_nats(NatsConfig(url=nats_url), "t-harness")
    session = await connect_nats(nats_as(nats_url, infra_secrets, "session-server"), "t-session")
    try:
        async def on_msg(msg):
            seen.append(msg.data)

        await worker.subscribe(subject("TRAJECTORIES", run_id), cb=on_msg)
        await worker.subscribe("_INBOX_trainer.>", cb=on_msg)  # nor another user's replies
        await harness.subscribe(subject("TRAJECTORIES", run_id), cb=on_msg)
        await worker.flush()
        await harness.flush()
        await session.publish(subject("TRAJECTORIES", run_id), b"episode")
        await session.publish("_INBOX_trainer.x", b"reply")  # the harness user is not this one either
        await session.flush()
        await asyncio.sleep(0.5)
        assert seen == [b"episode"]  # the harness's subscription only
    finally:
        for nc in (worker, harness, session):
            await nc.close()


def test_every_role_may_only_publish_its_own_streams():
    for role, spec in NATS_ROLES.items():
        allowed = nats_permissions(role, "r1")["publish"]["allow"]
        published = {s.rsplit(".", 1)[-1] for s in allowed if s.startswith("rlfleet.")}
        assert published == {"tasks_dead" if s == "TASKS_DEAD" else s.lower() for s in spec["publish"]}, role
        assert not any(s in (">", "*", "rlfleet.>") for s in allowed)
        assert all(f"$JS.API.STREAM.UPDATE.{s}" in allowed for s in spec["publish"])
        assert not any(s.startswith("$JS.API.STREAM.UPDATE.") and s.rsplit(".", 1)[-1] not in spec["publish"]
                       for s in allowed)
        assert not any("PURGE" in s or s.startswith("$JS.API.STREAM.DELETE") for s in allowed)


async def test_redis_without_the_password_is_refused(redis_url):
    with pytest.raises(StartupError, match="(?i)auth"):
        await connect_redis(RedisConfig(url=without_login(redis_url), connect_timeout_s=2))
    with pytest.raises(StartupError, match="(?i)(auth|password)"):
        await connect_redis(RedisConfig(url=without_login(redis_url), user="verifier", password="wrong"))


@pytest.mark.parametrize("error, attempts", [(AuthenticationError("WRONGPASS"), 1),
                                             (AuthorizationError("NOPERM"), 1),
                                             (RedisConnectionError("connection reset"), 4)])
async def test_a_refused_login_is_never_retried_a_lost_connection_is(error, attempts):
    """redis-py's login refusals are ConnectionErrors: retried like one, a wrong password took ~10 s to
    surface."""
    calls = []

    async def do():
        calls.append(1)
        raise error

    async def fail(_error):
        pass

    with pytest.raises(type(error)):
        await RetryNotRefusals(NoBackoff(), retries=3).call_with_retry(do, fail)
    assert len(calls) == attempts


async def test_a_redis_user_only_touches_its_own_keys(redis_url, infra_secrets):
    run_id = unique_run_id("auth")
    verifier = await connect_redis(redis_as(redis_url, infra_secrets, "verifier"))
    try:
        await verifier.set(key(run_id, "verdicts", "s1"), b"ok")  # its own part
        assert await verifier.get(key(run_id, "verdicts", "s1")) == b"ok"
        with pytest.raises(NoPermissionError):
            await verifier.hset(key(run_id, "session", "s1"), "state", b"forged")  # the session server's
        # ... which it may read (the episode it scores, where the session server keeps it), never write
        assert await verifier.hmget(key(run_id, "session", "s1"), "session", "owner") == [None, None]
        with pytest.raises(NoPermissionError):
            await verifier.delete(key(run_id, "session", "s1"))
        with pytest.raises(NoPermissionError):
            await verifier.get(key(run_id, "broker", "versions"))
        with pytest.raises(NoPermissionError):
            await verifier.flushall()
        with pytest.raises(NoPermissionError):
            await verifier.keys("*")
    finally:
        await verifier.aclose()
    session = await connect_redis(redis_as(redis_url, infra_secrets, "session-server"))
    try:
        assert await session.get(key(run_id, "verdicts", "s1")) == b"ok"  # reads verdicts at CloseSession
        # admits (the create script: a slot, the counts, by the policy, the gateway's advert and the
        # adapter routes, which it only reads) and gives back a closed session's slot and affinity
        assert await session.zrem(key(run_id, "admission", "inflight"), "s1") == 0
        assert await session.hincrby(key(run_id, "admission", "counts"), "admitted", 1) == 1
        assert await session.getdel(key(run_id, "affinity", "s1")) is None
        for readable in ("admission:policy", "admission:fleet", "adapter_routes"):
            assert await session.hgetall(key(run_id, *readable.split(":"))) == {}
            with pytest.raises(NoPermissionError):
                await session.hset(key(run_id, *readable.split(":")), "max_inflight_sessions", 0)
    finally:
        await session.aclose()


async def test_only_the_operator_adds_revocations_and_every_service_reads_them(redis_url, infra_secrets):
    run_id = unique_run_id("revoked")
    operator = await connect_redis(redis_as(redis_url, infra_secrets, "operator"))
    try:
        await revocations.revoke(operator, run_id, "t1")
        with pytest.raises(NoPermissionError):
            await operator.get(key(run_id, "session", "s1"))  # revocations are all it touches
    finally:
        await operator.aclose()
    for user in ("session-server", "rollout-gateway", "weight-broker", "sandbox-manager", "verifier"):
        service = await connect_redis(redis_as(redis_url, infra_secrets, user))
        try:
            assert await revocations.revoked(service, run_id) == {"t1"}, user
            with pytest.raises(NoPermissionError):
                await service.srem(revocations.revoked_key(run_id), "t1")  # nobody un-revokes a token
        finally:
            await service.aclose()
