"""Leases in Redis: which leases a (re)starting manager removes, and which it leaves to their live owners."""

from __future__ import annotations

import time

import pytest

from rlfleet.common.config import RedisConfig
from rlfleet.common.redis_store import connect_redis
from rlfleet.common.testing import unique_run_id
from rlfleet.sandbox.leases import LeaseStore, Owner

pytestmark = pytest.mark.integration


def store(redis, run_id: str, instance: str, host: str = "h1", root: str = "/r1") -> LeaseStore:
    return LeaseStore(redis, run_id, Owner(instance, host, root, 1), grace_s=60, heartbeat_s=5)


async def test_a_restarted_manager_removes_its_predecessors_and_dead_owners_leases_only(redis_url):
    redis = await connect_redis(RedisConfig(url=redis_url))
    run_id = unique_run_id("lease")
    now = time.time()
    predecessor = store(redis, run_id, "old")  # same host and root: dead, since we hold the root's lock
    alive_elsewhere = store(redis, run_id, "alive", host="h2")
    dead_elsewhere = store(redis, run_id, "dead", host="h3")
    await alive_elsewhere.heartbeat()
    await predecessor.heartbeat()  # its liveness key has not expired yet: the root lock still proves it dead
    for lease, sandbox_id in ((predecessor, "a"), (alive_elsewhere, "b"), (dead_elsewhere, "c")):
        await lease.grant(sandbox_id, created_at=now, expires_at=now + 30, session_id="s")

    successor = store(redis, run_id, "new")
    await successor.grant("d", created_at=now, expires_at=now + 30, session_id="s")
    recovery = await successor.recover()
    assert (recovery.predecessor_leases, recovery.dead_owner_leases) == (["a"], ["c"])
    assert [await redis.exists(successor.lease_key(i)) for i in "abcd"] == [0, 1, 0, 1]
    assert await successor.owned() == ["d"]
    assert 30_000 < await redis.pttl(successor.lease_key("d")) <= 90_000  # expiry + grace

    await successor.release("d")
    await successor.retire()
    assert not await redis.exists(successor.lease_key("d"), successor.manager_key("new"))
    await redis.aclose()
