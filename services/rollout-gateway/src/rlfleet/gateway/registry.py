"""The engine registry: which engines exist, and their live state, shared by gateway replicas in Redis.

Redis layout (namespaced by run):

    rlfleet:<run>:engines              HASH  engine_id -> JSON {url, pool, kind, labels}   (registration)
    rlfleet:<run>:engine:<engine_id>   HASH  healthy, paused, draining, policy_version,    (live status)
                                             in_flight, last_error, last_health_ms

Registration and status are separate keys, and status is written field by field, so that a replica
pausing an engine and another replica's health probe never overwrite each other's fields. Each
replica keeps a local copy (`refresh()` reloads it; the health checker does so every interval) so
routing a request does not read the whole registry from Redis.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import aiohttp
import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from rlfleet.api.gateway.v1 import gateway_pb2
from rlfleet.common.engine_client import EngineClient, EngineTimeouts
from rlfleet.common.redis_store import key, text
from rlfleet.gateway.errors import EngineNotFound

State = gateway_pb2.EngineState


@dataclass
class EngineRecord:
    engine_id: str
    url: str
    pool: gateway_pb2.EnginePool = gateway_pb2.ENGINE_POOL_FLEET
    kind: gateway_pb2.EngineKind = gateway_pb2.ENGINE_KIND_UNSPECIFIED
    labels: dict[str, str] = field(default_factory=dict)
    healthy: bool = False  # until the first probe answers
    paused: str = ""  # the pause mode while paused by PauseEngines
    draining: bool = False
    policy_version: int = -1  # unknown until the first probe
    in_flight: int = 0  # running + waiting requests the engine reported at the last probe
    last_error: str = ""
    last_health_ms: int = 0

    @property
    def state(self) -> gateway_pb2.EngineState:
        if not self.healthy:
            return State.ENGINE_STATE_UNHEALTHY
        if self.paused:
            return State.ENGINE_STATE_PAUSED
        if self.draining:
            return State.ENGINE_STATE_DRAINING
        return State.ENGINE_STATE_HEALTHY

    @property
    def state_name(self) -> str:
        return State.Name(self.state).removeprefix("ENGINE_STATE_").lower()

    def to_proto(self, sessions: int = 0, local_in_flight: int = 0) -> gateway_pb2.Engine:
        return gateway_pb2.Engine(
            engine_id=self.engine_id, url=self.url, pool=self.pool, kind=self.kind, state=self.state,
            policy_version=self.policy_version, in_flight_requests=max(self.in_flight, local_in_flight),
            sessions=sessions, last_error=self.last_error, last_health_unix_ms=self.last_health_ms,
            labels=self.labels)


def _registration(record: EngineRecord) -> bytes:
    return json.dumps({"url": record.url, "pool": record.pool, "kind": record.kind,
                       "labels": record.labels}).encode()


def _status_fields(record: EngineRecord) -> dict[FieldT, EncodableT]:
    return {"healthy": "1" if record.healthy else "0", "paused": record.paused,
            "draining": "1" if record.draining else "0", "policy_version": str(record.policy_version),
            "in_flight": str(record.in_flight), "last_error": record.last_error,
            "last_health_ms": str(record.last_health_ms)}


def _apply_status(record: EngineRecord, raw: dict[bytes, bytes]) -> None:
    status = {k.decode(): v.decode() for k, v in raw.items()}
    record.healthy = status.get("healthy", "0") == "1"
    record.paused = status.get("paused", "")
    record.draining = status.get("draining", "0") == "1"
    record.policy_version = int(status.get("policy_version", "-1"))
    record.in_flight = int(status.get("in_flight", "0"))
    record.last_error = status.get("last_error", "")
    record.last_health_ms = int(status.get("last_health_ms", "0"))


class EngineRegistry:
    """Engines by id, their HTTP clients (one shared connection pool) and this replica's in-flight counts."""

    def __init__(self, redis: aioredis.Redis, run_id: str, timeouts: EngineTimeouts, *,
                 api_key: str = "", admin_api_key: str = "") -> None:
        self.redis = redis
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.run_id = run_id
        self.timeouts = timeouts
        self.engines: dict[str, EngineRecord] = {}
        self.local_in_flight: dict[str, int] = {}
        self._busy_s: dict[str, float] = {}
        self._busy_since: dict[str, float] = {}
        self._clients: dict[str, EngineClient] = {}
        # No per-host connection cap: a busy engine gets as many concurrent requests as callers send.
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, limit_per_host=0))

    def _registry_key(self) -> str:
        return key(self.run_id, "engines")

    def _status_key(self, engine_id: str) -> str:
        return key(self.run_id, "engine", engine_id)

    async def close(self) -> None:
        await self._http.close()

    # --- reading --------------------------------------------------------------------------------
    async def refresh(self) -> None:
        """Reloads every engine and its status from Redis (what other replicas registered or saw)."""
        registrations = await self.redis.hgetall(self._registry_key())
        ids = sorted(text(raw_id) for raw_id in registrations)
        async with self.redis.pipeline(transaction=False) as pipe:
            for engine_id in ids:
                pipe.hgetall(self._status_key(engine_id))
            statuses = await pipe.execute()
        engines = {}
        for engine_id, status in zip(ids, statuses, strict=True):
            spec = json.loads(registrations[engine_id.encode()])
            record = EngineRecord(engine_id, spec["url"], spec["pool"], spec["kind"], spec.get("labels", {}))
            _apply_status(record, status)
            engines[engine_id] = record
        self.engines = engines

    def get(self, engine_id: str) -> EngineRecord:
        try:
            return self.engines[engine_id]
        except KeyError:
            raise EngineNotFound(engine_id) from None

    def select(self, engine_ids: list[str]) -> tuple[list[EngineRecord], list[str]]:
        """(known engines, unknown ids) for a request naming engines; no names = every engine."""
        if not engine_ids:
            return list(self.engines.values()), []
        return ([self.engines[e] for e in engine_ids if e in self.engines],
                [e for e in engine_ids if e not in self.engines])

    def client(self, record: EngineRecord) -> EngineClient:
        client = self._clients.get(record.engine_id)
        if client is None or client.base_url != record.url.rstrip("/"):
            client = EngineClient(record.url, timeouts=self.timeouts, session=self._http,
                                  api_key=self.api_key, admin_api_key=self.admin_api_key)
            self._clients[record.engine_id] = client
        return client

    def fleet_min_version(self, pools: frozenset[int] | None = None) -> int | None:
        """The oldest policy version among engines that take new sessions (of `pools`); None when none
        is known."""
        versions = [e.policy_version for e in self.engines.values()
                    if e.healthy and not e.draining and e.policy_version >= 0
                    and (pools is None or e.pool in pools)]
        return min(versions) if versions else None

    # --- writing --------------------------------------------------------------------------------
    async def register(self, record: EngineRecord) -> EngineRecord:
        """Adds an engine, or updates the registration of a known one (keeping its live status
        unless its URL changed: then it is a different server and starts unprobed)."""
        known = self.engines.get(record.engine_id)
        if known is None:
            raw = await self.redis.hget(self._registry_key(), record.engine_id)
            same_url = raw is not None and json.loads(raw)["url"] == record.url
        else:
            same_url = known.url == record.url
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._registry_key(), record.engine_id, _registration(record))
            if same_url:
                pipe.hset(self._status_key(record.engine_id), "draining", "1" if record.draining else "0")
            else:
                pipe.delete(self._status_key(record.engine_id))
                pipe.hset(self._status_key(record.engine_id), mapping=_status_fields(record))
            await pipe.execute()
        await self.refresh()
        return self.engines[record.engine_id]

    async def deregister(self, engine_id: str) -> None:
        removed = await self.redis.hdel(self._registry_key(), engine_id)
        await self.redis.delete(self._status_key(engine_id))
        self.engines.pop(engine_id, None)
        self._clients.pop(engine_id, None)
        if not removed:
            raise EngineNotFound(engine_id)

    async def update(self, engine_id: str, **fields: object) -> None:
        """Sets some live-status fields here and in Redis; an engine deregistered meanwhile is left alone."""
        record = self.engines.get(engine_id)
        if record is None:
            return
        for name, value in fields.items():
            setattr(record, name, value)
        status = _status_fields(record)
        changed: dict[FieldT, EncodableT] = {name: status[name] for name in fields}
        if await self.redis.hexists(self._registry_key(), engine_id):
            await self.redis.hset(self._status_key(engine_id), mapping=changed)

    async def mark_unhealthy(self, engine_id: str, error: str) -> None:
        await self.update(engine_id, healthy=False, last_error=error[:1000], last_health_ms=now_ms())

    # --- this replica's load --------------------------------------------------------------------
    def begin_request(self, engine_id: str) -> None:
        count = self.local_in_flight.get(engine_id, 0)
        if count == 0:
            self._busy_since[engine_id] = time.monotonic()
        self.local_in_flight[engine_id] = count + 1

    def end_request(self, engine_id: str) -> None:
        count = max(0, self.local_in_flight.get(engine_id, 0) - 1)
        self.local_in_flight[engine_id] = count
        if count == 0 and engine_id in self._busy_since:
            self._busy_s[engine_id] = self.busy_seconds(engine_id)
            del self._busy_since[engine_id]

    def busy_seconds(self, engine_id: str) -> float:
        """Seconds this replica has had at least one request on the engine (its utilisation, over time)."""
        since = self._busy_since.get(engine_id)
        return self._busy_s.get(engine_id, 0.0) + (time.monotonic() - since if since is not None else 0.0)


def now_ms() -> int:
    return int(time.time() * 1000)
