"""Which LoRA adapter each pool role is served with: the weight broker sets it, the gateway reads it.

Canary without a second engine: the candidate adapter and the accepted one are loaded side by side
on the same engines (`/load_lora_adapter`), and a request names the adapter it wants (`lora_path`).
The gateway decides which by the request's role:

- `canary`: rollouts while the gate holds a candidate (the gateway's `route_pools` is `["canary"]`)
  and the gate's candidate evaluation (sessions pinned to ENGINE_POOL_CANARY);
- `fleet`: everything else (the accepted policy: sessions pinned to ENGINE_POOL_FLEET, and every
  unpinned session when the gateway routes to the fleet pool).

A role with a route is served on any engine the gateway knows (every engine holds the adapters:
the broker loads an adapter on all of them before it names it here). `canary` without a route of
its own gets `fleet`'s (no candidate: rollouts run the accepted policy). A role with no route at all
is routed by engine pool as before, on the base model. Promotion and rollback are one `set` call
(no weight copy); the broker unloads the adapter no role names only after the switch.

Redis layout (namespaced by run):

    rlfleet:<run>:adapter_routes   HASH  role (canary | fleet) -> JSON {lora_name, version}

`lora_name` is the name the adapter was loaded under on the engines; `version` is its policy version
(what the gateway reports as the version of every token served with it: SGLang's own
`weight_version` is the base model's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.typing import EncodableT, FieldT

from rlfleet.common.redis_store import key, text

ROLES = ("canary", "fleet")


@dataclass(frozen=True)
class AdapterRoute:
    lora_name: str
    version: int

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("an adapter route needs the adapter's lora_name")
        if self.version < 0:
            raise ValueError(f"an adapter route needs a policy version >= 0, got {self.version}")


def routes_key(run_id: str) -> str:
    """The routes hash (a script that needs a role's version reads it there itself)."""
    return key(run_id, "adapter_routes")


class AdapterRoutes:
    def __init__(self, redis: aioredis.Redis, run_id: str) -> None:
        self.redis = redis
        self._key = routes_key(run_id)

    async def set(self, **routes: AdapterRoute | None) -> None:
        """Sets (a route) or clears (None) the named roles, all in one transaction: a promotion that
        moves the candidate to `fleet` and clears `canary` is never seen half done."""
        unknown = sorted(set(routes) - set(ROLES))
        if unknown:
            raise ValueError(f"unknown roles {unknown}; roles are {', '.join(ROLES)}")
        present: dict[FieldT, EncodableT] = {role: json.dumps({"lora_name": r.lora_name,
                                                               "version": r.version})
                                             for role, r in routes.items() if r is not None}
        absent = [role for role, r in routes.items() if r is None]
        async with self.redis.pipeline(transaction=True) as pipe:
            if present:
                pipe.hset(self._key, mapping=present)
            if absent:
                pipe.hdel(self._key, *absent)
            await pipe.execute()

    async def get(self, role: str) -> AdapterRoute | None:
        return _route(await self.redis.hget(self._key, role))

    async def all(self) -> dict[str, AdapterRoute]:
        return self.parse(await self.redis.hgetall(self._key))

    def queue_all(self, pipe: Pipeline) -> None:
        """Adds the read of every route to `pipe` (its reply goes to `parse`): a caller that talks to
        Redis anyway reads the routes in the same round trip, as fresh as a read of their own."""
        pipe.hgetall(self._key)

    def parse(self, raw: dict) -> dict[str, AdapterRoute]:
        """The routes of an HGETALL reply of the routes hash."""
        return {text(role): route for role, value in raw.items() if (route := _route(value)) is not None}


def _route(raw: bytes | str | None) -> AdapterRoute | None:
    if raw is None:
        return None
    value = json.loads(raw)
    return AdapterRoute(str(value["lora_name"]), int(value["version"]))
