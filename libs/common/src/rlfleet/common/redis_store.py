"""Redis: hot shared state (sessions, leases, engine registry, verdicts), namespaced by run."""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from rlfleet.common.config import RedisConfig, require
from rlfleet.common.errors import StartupError


async def connect_redis(config: RedisConfig) -> aioredis.Redis:
    """Connects and pings, so an unreachable Redis is a one-line start-up error, not a later hang."""
    url = require(config.url, "redis.url")
    client = aioredis.Redis.from_url(url, socket_connect_timeout=config.connect_timeout_s,
                                     socket_timeout=max(config.connect_timeout_s, 10.0), decode_responses=False)
    try:
        await client.ping()
    except (RedisError, OSError) as exc:
        await client.aclose()
        raise StartupError(f"cannot reach Redis at {url}: {exc}") from None
    return client


def key(run_id: str, *parts: str) -> str:
    """`rlfleet:<run>:<part>:...` so that runs sharing one Redis never see each other's keys."""
    return ":".join(("rlfleet", run_id, *parts))
