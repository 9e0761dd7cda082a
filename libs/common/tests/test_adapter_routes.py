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
