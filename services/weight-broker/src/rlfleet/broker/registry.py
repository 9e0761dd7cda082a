"""The version registry in Redis: every version's state and times, the pools' targets, and which
engine serves which version. It is the broker's whole state, so a restarted broker carries on.

Keys (namespaced by run; values are serialized protobufs where a message exists):

    rlfleet:<run>:broker:versions        ZSET   version numbers (score = version)
    rlfleet:<run>:broker:version:<v>     STRING VersionRecord
    rlfleet:<run>:broker:targets         HASH   canary, fleet, candidate (target versions), latest,
                                                last_synced
    rlfleet:<run>:broker:engines         HASH   engine_id -> EngineVersion (what it serves, last update)
    rlfleet:<run>:broker:drained         SET    engines drained for a weight catch-up, to un-drain after

One active broker per run writes these (read-modify-write under the broker's own lock).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from rlfleet.api.broker.v1 import broker_pb2
from rlfleet.broker.errors import UnknownVersion
from rlfleet.common.redis_store import key, members, text

State = broker_pb2.VersionState


def now_ms() -> int:
    return int(time.time() * 1000)


def state_name(state: int) -> str:
    return State.Name(state).removeprefix("VERSION_STATE_")


@dataclass(frozen=True)
class Targets:
    canary: int | None = None
    fleet: int | None = None
    latest: int | None = None
    last_synced: int | None = None
    candidate: int | None = None  # pinned for the promotion gate (PinCandidate)

    def for_pool(self, pool: str) -> int | None:
        if pool == "candidate":  # with no pin, the accepted version: never an unvetted one
            return self.candidate if self.candidate is not None else self.fleet
        return self.canary if pool == "canary" else self.fleet


class VersionRegistry:
    def __init__(self, redis: aioredis.Redis, run_id: str) -> None:
        self.redis = redis
        self.run_id = run_id

    def _key(self, *parts: str) -> str:
        return key(self.run_id, "broker", *parts)

    # --- versions -------------------------------------------------------------------------------
    async def get(self, version: int) -> broker_pb2.VersionRecord | None:
        raw = await self.redis.get(self._key("version", str(version)))
        return None if raw is None else broker_pb2.VersionRecord.FromString(raw)

    async def require(self, version: int) -> broker_pb2.VersionRecord:
        """get() for a version that must be known: UnknownVersion (NOT_FOUND) when it is not."""
        record = await self.get(version)
        if record is None:
            raise UnknownVersion(version)
        return record

    async def put(self, record: broker_pb2.VersionRecord) -> None:
        v = record.version.version
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self._key("version", str(v)), record.SerializeToString())
            pipe.zadd(self._key("versions"), {str(v): v})
            await pipe.execute()

    async def set_state(
        self, record: broker_pb2.VersionRecord, state: broker_pb2.VersionState, reason: str = ""
    ) -> broker_pb2.VersionRecord:
        record.state = state
        if reason:
            record.reason = reason
        stamp = now_ms()
        if state == State.VERSION_STATE_CANARY and not record.canary_unix_ms:
            record.canary_unix_ms = stamp
        elif state == State.VERSION_STATE_ACCEPTED:
            record.accepted_unix_ms = stamp
        elif state in (State.VERSION_STATE_REJECTED, State.VERSION_STATE_ROLLED_BACK):
            record.rejected_unix_ms = stamp
        await self.put(record)
        return record

    async def versions(self, low: int | None = None, high: int | None = None) -> list[int]:
        """Known version numbers in [low, high], ascending."""
        raw = await self.redis.zrangebyscore(
            self._key("versions"), "-inf" if low is None else low, "+inf" if high is None else high
        )
        return [int(v) for v in members(raw)]

    async def records(self, versions: Iterable[int]) -> list[broker_pb2.VersionRecord]:
        keys = [self._key("version", str(v)) for v in versions]
        if not keys:
            return []
        return [broker_pb2.VersionRecord.FromString(raw) for raw in await self.redis.mget(keys)
                if raw is not None]

    async def newest(self, limit: int = 0) -> list[broker_pb2.VersionRecord]:
        raw = await self.redis.zrevrange(self._key("versions"), 0, (limit or 0) - 1)
        return await self.records(int(v) for v in members(raw))

    async def newest_in_state(
        self, states: set[broker_pb2.VersionState], below: int | None = None
    ) -> int | None:
        """The newest version (< below) in one of `states`."""
        high = "+inf" if below is None else f"({below}"
        raw = await self.redis.zrevrangebyscore(self._key("versions"), high, "-inf")
        for record in await self.records(int(v) for v in members(raw)):
            if record.state in states:
                return record.version.version
        return None

    # --- targets --------------------------------------------------------------------------------
    async def targets(self) -> Targets:
        raw = await self.redis.hgetall(self._key("targets"))
        values = {text(k): int(v) for k, v in raw.items()}
        return Targets(values.get("canary"), values.get("fleet"), values.get("latest"),
                       values.get("last_synced"), values.get("candidate"))

    async def set_targets(self, **values: int | None) -> None:
        present: dict[FieldT, EncodableT] = {k: str(v) for k, v in values.items() if v is not None}
        absent = [k for k, v in values.items() if v is None]
        async with self.redis.pipeline(transaction=True) as pipe:
            if present:
                pipe.hset(self._key("targets"), mapping=present)
            if absent:
                pipe.hdel(self._key("targets"), *absent)
            await pipe.execute()

    # --- engines --------------------------------------------------------------------------------
    async def engine(self, engine_id: str) -> broker_pb2.EngineVersion | None:
        raw = await self.redis.hget(self._key("engines"), engine_id)
        return None if raw is None else broker_pb2.EngineVersion.FromString(raw)

    async def engines(self) -> dict[str, broker_pb2.EngineVersion]:
        raw = await self.redis.hgetall(self._key("engines"))
        return {text(k): broker_pb2.EngineVersion.FromString(v) for k, v in raw.items()}

    async def put_engine(self, record: broker_pb2.EngineVersion) -> None:
        await self.redis.hset(self._key("engines"), record.engine_id, record.SerializeToString())

    async def forget_engines(self, keep: Iterable[str]) -> None:
        """Drops the records of engines that left the pools."""
        keep = set(keep)
        gone = [e for e in await self.redis.hkeys(self._key("engines")) if text(e) not in keep]
        if gone:
            await self.redis.hdel(self._key("engines"), *gone)

    async def mark_drained(self, engine_id: str, drained: bool) -> None:
        if drained:
            await self.redis.sadd(self._key("drained"), engine_id)
        else:
            await self.redis.srem(self._key("drained"), engine_id)

    async def drained(self) -> set[str]:
        return {text(e) for e in await self.redis.smembers(self._key("drained"))}
