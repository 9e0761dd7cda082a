"""The version registry on real Redis: a version that must be known and is not is NOT_FOUND."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from rlfleet.api.broker.v1 import broker_pb2
from rlfleet.api.common.v1 import common_pb2
from rlfleet.broker.errors import UnknownVersion
from rlfleet.broker.registry import State, VersionRegistry
from rlfleet.common.testing import unique_run_id

pytestmark = pytest.mark.integration


async def test_require_returns_a_known_version_and_names_an_unknown_one(redis_url):
    redis = aioredis.Redis.from_url(redis_url)
    try:
        registry = VersionRegistry(redis, unique_run_id("reg"))
        record = broker_pb2.VersionRecord(
            version=common_pb2.PolicyVersion(version=3), state=State.VERSION_STATE_ANNOUNCED
        )
        await registry.put(record)
        assert (await registry.require(3)).state == State.VERSION_STATE_ANNOUNCED
        assert await registry.versions() == [3]
        with pytest.raises(UnknownVersion):
            await registry.require(4)
    finally:
        await redis.aclose()
