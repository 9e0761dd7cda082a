"""The adapter routes the weight broker sets and the gateway reads, on real Redis."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from rlfleet.common.adapter_routes import AdapterRoute, AdapterRoutes
from rlfleet.common.testing import unique_run_id

pytestmark = pytest.mark.integration


async def test_roles_are_set_and_cleared_together_and_runs_do_not_share_them(redis_url):
    redis = aioredis.Redis.from_url(redis_url)
    try:
        routes, other = AdapterRoutes(redis, unique_run_id("ar")), AdapterRoutes(redis, unique_run_id("ar"))
        await routes.set(canary=AdapterRoute("v5", 5), fleet=AdapterRoute("v4", 4))
        assert await routes.all() == {"canary": AdapterRoute("v5", 5), "fleet": AdapterRoute("v4", 4)}
        await routes.set(fleet=AdapterRoute("v5", 5), canary=None)  # a promotion, in one transaction
        assert await routes.get("canary") is None and await routes.get("fleet") == AdapterRoute("v5", 5)
        assert await other.all() == {}
    finally:
        await redis.aclose()


def test_bad_routes_are_refused_before_anything_is_written():
    with pytest.raises(ValueError, match="unknown roles"):
        asyncio.run(AdapterRoutes(None, "run").set(stable=AdapterRoute("v1", 1)))
    with pytest.raises(ValueError, match="lora_name"):
        AdapterRoute("", 1)
    with pytest.raises(ValueError, match="policy version"):
        AdapterRoute("v1", -1)


async def test_every_read_sees_the_routes_as_they_are_now(redis_url):
    """The parse of an unchanged hash is reused, never the routes: a switch shows on the next read
    (the broker unloads the adapter no role names right after it)."""
    redis = aioredis.Redis.from_url(redis_url)
    try:
        routes = AdapterRoutes(redis, unique_run_id("ar"))
        await routes.set(fleet=AdapterRoute("v1", 1))
        assert await routes.all() == {"fleet": AdapterRoute("v1", 1)}
        assert await routes.all() == {"fleet": AdapterRoute("v1", 1)}  # unchanged: the same parse
        await routes.set(fleet=AdapterRoute("v2", 2), canary=AdapterRoute("v3", 3))
        assert await routes.all() == {"fleet": AdapterRoute("v2", 2), "canary": AdapterRoute("v3", 3)}
        async with redis.pipeline(transaction=False) as pipe:  # read with other commands, as the gateway does
            routes.queue_all(pipe)
            pipe.ping()
            raw, _pong = await pipe.execute()
        assert routes.parse(raw) == {"fleet": AdapterRoute("v2", 2), "canary": AdapterRoute("v3", 3)}
        await routes.set(fleet=None, canary=None)
        assert await routes.all() == {}
    finally:
        await redis.aclose()
