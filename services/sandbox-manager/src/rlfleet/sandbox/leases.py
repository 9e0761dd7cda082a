"""Sandbox leases in Redis: which manager holds which sandbox, until when.

    rlfleet:<run>:sandbox:leases:<sandbox_id>    hash: owner, host, root, pid, session_id,
                                                 created_unix_ms, expires_unix_ms
                                                 (the key expires lease_grace_s after the sandbox)
    rlfleet:<run>:sandbox:managers:<instance>    JSON {host, root, pid, started_unix_ms}, refreshed
                                                 every heartbeat; expires 3 heartbeats after the last

A lease is stale when its owner is gone. Two ways to know:

- it names this manager's host and root but another instance: the driver holds an exclusive lock on
  its root, so whoever wrote that lease is dead (a predecessor killed before it could clean up). The
  driver's start has already swept the root's workspaces and killed its uid range; the lease goes.
- its owner's liveness key has expired (a manager elsewhere that died): the lease goes.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from redis.typing import EncodableT, FieldT

from rlfleet.common.errors import Unavailable
from rlfleet.common.redis_store import key, text

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Owner:
    instance_id: str
    host: str
    root: str
    pid: int

    @classmethod
    def this_process(cls, root: str) -> Owner:
        host = socket.gethostname()
        return cls(f"{host}-{os.getpid()}-{secrets.token_hex(4)}", host, os.path.realpath(root), os.getpid())


@dataclass(frozen=True)
class Recovery:
    """What start-up cleaned up: leases of a predecessor on this root, and of dead managers elsewhere."""

    predecessor_leases: list[str]
    dead_owner_leases: list[str]


class LeaseStore:
    def __init__(self, redis: aioredis.Redis, run_id: str, owner: Owner, *, grace_s: float,
                 heartbeat_s: float) -> None:
        self.redis = redis
        self.run_id = run_id
        self.owner = owner
        self.grace_s = grace_s
        self.heartbeat_s = heartbeat_s

    def lease_key(self, sandbox_id: str) -> str:
        return key(self.run_id, "sandbox", "leases", sandbox_id)

    def manager_key(self, instance_id: str) -> str:
        return key(self.run_id, "sandbox", "managers", instance_id)

    async def grant(self, sandbox_id: str, *, created_at: float, expires_at: float, session_id: str) -> None:
        name = self.lease_key(sandbox_id)
        fields: dict[FieldT, EncodableT] = {
            "owner": self.owner.instance_id, "host": self.owner.host, "root": self.owner.root,
            "pid": str(self.owner.pid), "session_id": session_id,
            "created_unix_ms": str(int(created_at * 1000)), "expires_unix_ms": str(int(expires_at * 1000))}
        ttl_ms = max(1, int((expires_at - time.time() + self.grace_s) * 1000))
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hset(name, mapping=fields)
                pipe.pexpire(name, ttl_ms)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            raise Unavailable(f"cannot record the sandbox's lease in Redis: {exc}") from None

    async def release(self, sandbox_id: str) -> None:
        """Drops a lease; if Redis cannot be reached the lease's own expiry removes it later."""
        try:
            await self.redis.delete(self.lease_key(sandbox_id))
        except (RedisError, OSError) as exc:
            log.warning("could not drop the lease of sandbox %s (it expires on its own): %s", sandbox_id, exc)

    async def heartbeat(self) -> None:
        payload = json.dumps({"host": self.owner.host, "root": self.owner.root, "pid": self.owner.pid,
                              "at_unix_ms": int(time.time() * 1000)})
        await self.redis.set(self.manager_key(self.owner.instance_id), payload,
                             px=int(self.heartbeat_s * 3 * 1000))

    async def retire(self) -> None:
        """On a clean stop: this manager's liveness key goes (its leases went with its sandboxes)."""
        await self.redis.delete(self.manager_key(self.owner.instance_id))

    async def owned(self) -> list[str]:
        return [sandbox_id for sandbox_id, lease in await self._all()
                if lease.get("owner") == self.owner.instance_id]

    async def recover(self) -> Recovery:
        """Removes stale leases; call once the driver holds its root (so predecessors are dead)."""
        predecessor, dead = [], []
        for sandbox_id, lease in await self._all():
            owner = lease.get("owner", "")
            if owner == self.owner.instance_id:
                continue
            if lease.get("host") == self.owner.host and lease.get("root") == self.owner.root:
                predecessor.append(sandbox_id)
            elif not await self.redis.exists(self.manager_key(owner)):
                dead.append(sandbox_id)
        for sandbox_id in predecessor + dead:
            await self.release(sandbox_id)
        return Recovery(predecessor, dead)

    async def _all(self) -> list[tuple[str, dict[str, str]]]:
        prefix = self.lease_key("")
        found = []
        async for name in self.redis.scan_iter(match=prefix + "*", count=500):
            raw = await self.redis.hgetall(name)
            if raw:
                lease = {text(k): text(v) for k, v in raw.items()}
                found.append((text(name)[len(prefix):], lease))
        return found
