"""Admission control: a session asks before it starts and releases its slot when it ends.

Two rules, applied atomically in one Redis script so that every gateway replica agrees:
- in-flight budget: at most `max_inflight_sessions` admitted and unreleased sessions (0 = no limit);
- staleness budget: no new session while the fleet's oldest policy version is more than
  `max_staleness` versions behind the trainer's (negative `max_staleness` = off).

Redis layout (namespaced by run):

    rlfleet:<run>:admission:policy     HASH  max_inflight_sessions, trainer_version, max_staleness
    rlfleet:<run>:admission:inflight   ZSET  session_id -> admitted at (unix ms); older than the lease are
                                             dropped
    rlfleet:<run>:admission:counts     HASH  admitted, refused:<reason>

A refusal is an answer, not an error: `admitted=false`, the reason and a retry hint.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.typing import EncodableT

from rlfleet.api.gateway.v1 import gateway_pb2
from rlfleet.common.session_slots import ADMIT_LUA, counts_key, fleet_key, inflight_key, policy_key
from rlfleet.gateway.errors import InvalidGatewayRequest

REASON_INFLIGHT = "inflight_limit"
REASON_STALE = "stale"

# KEYS: inflight zset, counts hash, policy hash[, adapter routes hash].
# ARGV: session_id, now_ms, lease cutoff ms, fleet min version ("" = unknown)[, adapter role].
_ADMIT = ADMIT_LUA + (
    "\nreturn admit(KEYS[1], KEYS[2], KEYS[3], KEYS[4] or false, ARGV[1], ARGV[2], ARGV[3], "
    "tonumber(ARGV[4]), ARGV[5])\n")


@dataclass(frozen=True)
class Decision:
    admitted: bool
    reason: str = ""
    retry_after_ms: int = 0


class Admission:
    def __init__(self, redis: aioredis.Redis, run_id: str, lease_s: float, retry_after_ms: int) -> None:
        self.redis = redis
        self.lease_ms = int(lease_s * 1000)
        self.retry_after_ms = retry_after_ms
        self.keys = [inflight_key(run_id), counts_key(run_id), policy_key(run_id)]
        self._fleet_key = fleet_key(run_id)
        self._advertised: tuple | None = None
        self._admit = redis.register_script(_ADMIT)

    async def seed_policy(self, max_inflight_sessions: int, max_staleness: int) -> None:
        """Config seeds the policy when none is stored; SetAdmissionPolicy changes it for every replica."""
        policy_key = self.keys[2]
        await self.redis.hsetnx(policy_key, "max_inflight_sessions", max_inflight_sessions)
        await self.redis.hsetnx(policy_key, "trainer_version", 0)
        await self.redis.hsetnx(policy_key, "max_staleness", max_staleness)

    async def admit(self, session_id: str, fleet_min_version: int | None,
                    adapter_routes: tuple[str, str] | None = None) -> Decision:
        """`fleet_min_version`: the engines' oldest version; `adapter_routes` (routes hash, role): the
        role's adapter version, when it has one, counts instead (read inside the script)."""
        if not session_id:
            raise InvalidGatewayRequest("session_id is required to admit a session", field="session_id")
        now = int(time.time() * 1000)
        fleet = "" if fleet_min_version is None else str(fleet_min_version)
        args: list[EncodableT] = [session_id, now, now - self.lease_ms, fleet]
        keys = self.keys
        if adapter_routes is not None:
            keys, args = [*keys, adapter_routes[0]], [*args, adapter_routes[1]]
        outcome = (await self._admit(keys=keys, args=args)).decode()
        if outcome == "admitted":
            return Decision(True)
        return Decision(False, outcome, self.retry_after_ms)

    async def advertise(self, engines_min_version: int | None, role: str, again: bool = False) -> None:
        """What a session server needs to admit in its own create script (rlfleet.common.session_slots):
        written when it changes, and with `again` (each health round) even when not, so that a lost
        key comes back (every replica of one config writes the same)."""
        fields = ("" if engines_min_version is None else str(engines_min_version), role, str(self.lease_ms),
                  str(self.retry_after_ms))
        if fields == self._advertised and not again:
            return
        await self.redis.hset(self._fleet_key, mapping=dict(zip(
            ("engines_min_version", "role", "lease_ms", "retry_after_ms"), fields, strict=True)))
        self._advertised = fields

    async def release(self, session_id: str) -> bool:
        return bool(await self.redis.zrem(self.keys[0], session_id))

    @property
    def inflight_key(self) -> str:
        """The ZSET of admitted sessions: a release is a ZREM of the session from it (Release sends it
        with the router's forget, one round trip)."""
        return self.keys[0]

    async def set_policy(self, policy: gateway_pb2.AdmissionPolicy) -> None:
        if policy.max_staleness >= 0 and policy.trainer_version < 0:
            raise InvalidGatewayRequest(f"trainer_version must be >= 0, got {policy.trainer_version}",
                                        field="trainer_version")
        await self.redis.hset(self.keys[2], mapping={
            "max_inflight_sessions": policy.max_inflight_sessions, "trainer_version": policy.trainer_version,
            "max_staleness": policy.max_staleness})

    async def status(self, fleet_min_version: int | None) -> gateway_pb2.AdmissionStatus:
        inflight_key, counts_key, policy_key = self.keys
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zremrangebyscore(inflight_key, "-inf", int(time.time() * 1000) - self.lease_ms)
            pipe.zcard(inflight_key)
            pipe.hgetall(counts_key)
            pipe.hmget(policy_key, "max_inflight_sessions", "trainer_version", "max_staleness")
            _purged, inflight, counts, policy = await pipe.execute()
        counts = {k.decode(): int(v) for k, v in counts.items()}
        refused = {k.removeprefix("refused:"): v for k, v in counts.items() if k.startswith("refused:")}
        max_inflight, trainer, staleness = (int(v) if v is not None else d
                                            for v, d in zip(policy, (0, 0, -1), strict=True))
        return gateway_pb2.AdmissionStatus(
            policy=gateway_pb2.AdmissionPolicy(max_inflight_sessions=max_inflight, trainer_version=trainer,
                                               max_staleness=staleness),
            inflight_sessions=inflight, admitted_total=counts.get("admitted", 0),
            refused_total=sum(refused.values()), refused_by_reason=refused,
            fleet_min_version=-1 if fleet_min_version is None else fleet_min_version)
