"""Session-affine routing: every turn of a session goes to the engine that served its first turn,
while that engine is healthy; a new session goes to the least-loaded engine that takes new sessions.

Redis layout (namespaced by run), so every gateway replica routes a session the same way:

    rlfleet:<run>:affinity:<session_id>          STRING engine_id, TTL `affinity_ttl_s` (renewed each turn)
    rlfleet:<run>:engine_sessions:<engine_id>    ZSET   session_id -> last turn (unix s)

An engine's load is the number of sessions that used it within the affinity TTL plus this replica's
requests in flight on it. Pools: the broker decides what runs where; a new session goes to an engine
of its pinned pool, or else of the configured `route_pools`, and never to a DRAINING one. A session
whose role (`role()`) the broker gave a LoRA adapter goes to any engine (all of them hold it).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from rlfleet.api.gateway.v1 import gateway_pb2
from rlfleet.common.redis_store import text
from rlfleet.common.session_slots import affinity_key, engine_sessions_key
from rlfleet.gateway.errors import NoEngineAvailable
from rlfleet.gateway.registry import EngineRecord, EngineRegistry

TOUCH_EVERY_S = 60.0
UNREAD = object()  # `route(affinity=...)`: the caller did not read the affinity key, route reads it

# KEYS: the session's affinity[, a ZSET to remove the session from too]. ARGV: the engine_sessions
# key prefix, session_id. One round trip for what would otherwise be a GETDEL and then a ZREM on the
# engine it named (and the release of the session's admission slot).
_FORGET = """
local engine = redis.call('GETDEL', KEYS[1])
if engine then redis.call('ZREM', ARGV[1] .. engine, ARGV[2]) end
if KEYS[2] then redis.call('ZREM', KEYS[2], ARGV[2]) end
return engine
"""


@dataclass(frozen=True)
class Route:
    engine: EngineRecord
    rerouted: bool = False
    reason: str = ""


class Router:
    def __init__(self, redis: aioredis.Redis, run_id: str, registry: EngineRegistry, affinity_ttl_s: float,
                 route_pools: frozenset[int] | None = None) -> None:
        self.route_pools = route_pools  # None: every pool
        self.redis = redis
        self.run_id = run_id
        self.registry = registry
        self.ttl_s = int(max(1, affinity_ttl_s))
        self._touched: dict[str, float] = {}  # session -> when this replica last counted it (monotonic)
        self._sessions_prefix = self._sessions_key("")
        self._forget = redis.register_script(_FORGET)

    def _affinity_key(self, session_id: str) -> str:
        return affinity_key(self.run_id, session_id)

    def _sessions_key(self, engine_id: str) -> str:
        return engine_sessions_key(self.run_id, engine_id)

    def pools_for(self, pinned: int) -> frozenset[int] | None:
        return frozenset({pinned}) if pinned else self.route_pools

    def role(self, pinned: int) -> str:
        """The adapter role (rlfleet.common.adapter_routes) of a request pinned to `pinned` (0: none):
        the candidate's (`canary`) for canary- or candidate-pinned requests, and for unpinned ones when
        rollouts go to the canary pool only; else the accepted policy's (`fleet`)."""
        canary = gateway_pb2.ENGINE_POOL_CANARY
        if pinned:
            return "canary" if pinned in (canary, gateway_pb2.ENGINE_POOL_CANDIDATE) else "fleet"
        return "canary" if self.route_pools == frozenset({canary}) else "fleet"

    def queue_affinity(self, pipe, session_id: str) -> None:
        """Adds the read (and renewal) of the session's affinity to `pipe`; its reply goes to `route`."""
        pipe.getex(self._affinity_key(session_id), ex=self.ttl_s)

    async def route(self, session_id: str, pool: int = 0, *, any_pool: bool = False,
                    affinity: object = UNREAD) -> Route:
        """The session's engine while it can serve, otherwise a new one (rerouted, with the reason).
        `any_pool`: every engine may serve it (its role has an adapter, which every engine holds).
        `affinity`: the reply of `queue_affinity` when the caller read it in a pipeline of its own."""
        pools = None if any_pool else self.pools_for(pool)
        if not session_id:
            return Route(await self.pick(exclude=(), pools=pools))
        raw = (await self.redis.getex(self._affinity_key(session_id), ex=self.ttl_s) if affinity is UNREAD
               else affinity)
        if raw is None:
            return await self._assign(session_id, previous=None, reason="", pools=pools)
        assert isinstance(raw, (bytes, str)), raw  # a GET reply, read here or by the caller
        engine_id = text(raw)
        engine = self.registry.engines.get(engine_id)
        if engine is None:
            await self.registry.refresh()  # registered through another replica since our last refresh?
            engine = self.registry.engines.get(engine_id)
        if engine is not None and engine.healthy:
            return Route(engine)
        reason = (f"engine {engine_id} is no longer registered" if engine is None
                  else f"engine {engine_id} is unhealthy: {engine.last_error or 'failed its health check'}")
        return await self._assign(session_id, previous=engine_id, reason=reason, pools=pools)

    async def reroute(self, session_id: str, failed: EngineRecord, reason: str, pool: int = 0, *,
                      any_pool: bool = False) -> Route:
        """After `failed` failed this session's request: another engine, recorded as its new affinity."""
        pools = None if any_pool else self.pools_for(pool)
        if not session_id:
            return Route(await self.pick(exclude=(failed.engine_id,), pools=pools), rerouted=True,
                         reason=reason)
        return await self._assign(session_id, previous=failed.engine_id, reason=reason, pools=pools)

    async def touch(self, session_id: str, engine_id: str) -> None:
        """Counts the session as active on its engine (after a turn). The count only needs to be as
        fresh as the affinity TTL, so each replica writes it at most once a minute per session."""
        if not session_id:
            return
        now = time.monotonic()
        if now - self._touched.get(session_id, -TOUCH_EVERY_S) < TOUCH_EVERY_S:
            return
        if len(self._touched) > 100_000:  # forget sessions that went quiet
            self._touched = {s: t for s, t in self._touched.items() if now - t < TOUCH_EVERY_S}
        self._touched[session_id] = now
        await self.redis.zadd(self._sessions_key(engine_id), {session_id: time.time()})

    async def forget(self, session_id: str, release_from: str = "") -> None:
        """The session ended: drop its affinity and its place in its engine's load, and from the ZSET
        `release_from` when given (the admission slot), all in one script."""
        keys = [self._affinity_key(session_id), *([release_from] if release_from else [])]
        await self._forget(keys=keys, args=[self._sessions_prefix, session_id])

    async def session_counts(self, engine_ids: list[str]) -> dict[str, int]:
        cutoff = time.time() - self.ttl_s
        async with self.redis.pipeline(transaction=False) as pipe:
            for engine_id in engine_ids:
                pipe.zremrangebyscore(self._sessions_key(engine_id), "-inf", cutoff)
                pipe.zcard(self._sessions_key(engine_id))
            replies = await pipe.execute()
        return dict(zip(engine_ids, replies[1::2], strict=True))

    async def pick(self, exclude: tuple[str, ...], pools: frozenset[int] | None = None) -> EngineRecord:
        """The least-loaded engine (of `pools`) that takes new sessions; paused ones only when nothing
        else can."""
        engines = [e for e in self.registry.engines.values()
                   if e.engine_id not in exclude and (pools is None or e.pool in pools)]
        candidates = [e for e in engines if e.healthy and not e.draining and not e.paused]
        candidates = candidates or [e for e in engines if e.healthy and not e.draining]
        if not candidates:
            raise NoEngineAvailable(_no_engine_message(list(self.registry.engines.values()), exclude),
                                    tried=exclude)
        if len(candidates) == 1:  # nothing to compare: its load would not change the choice
            return candidates[0]
        counts = await self.session_counts([e.engine_id for e in candidates])
        loads = {e.engine_id: counts[e.engine_id] + self.registry.local_in_flight.get(e.engine_id, 0)
                 for e in candidates}
        lightest = min(loads.values())
        # Ties broken at random so that replicas deciding at the same moment do not pile onto one engine.
        return random.choice([e for e in candidates if loads[e.engine_id] == lightest])

    async def _assign(self, session_id: str, previous: str | None, reason: str,
                      pools: frozenset[int] | None = None) -> Route:
        exclude = (previous,) if previous else ()
        engine = await self.pick(exclude=exclude, pools=pools)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self._affinity_key(session_id), engine.engine_id, ex=self.ttl_s)
            pipe.zadd(self._sessions_key(engine.engine_id), {session_id: time.time()})
            if previous:
                pipe.zrem(self._sessions_key(previous), session_id)
            await pipe.execute()
        self._touched[session_id] = time.monotonic()
        return Route(engine, rerouted=previous is not None, reason=reason)


def _no_engine_message(engines: list[EngineRecord], failed: tuple[str, ...]) -> str:
    if not engines:
        return "no engine is registered with the gateway (config `engines` or RegisterEngine)"
    states = ", ".join(f"{e.engine_id}: {'failed this request' if e.engine_id in failed else e.state_name}"
                       + (f" ({e.last_error})" if e.last_error and not e.healthy else "")
                       for e in engines)
    return f"no engine can take the request ({states})"
