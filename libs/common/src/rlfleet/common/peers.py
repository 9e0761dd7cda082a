"""An App that connects to NATS (ensuring the streams) and/or Redis before serving.

Apart from `rlfleet.common.service` because a service's entry point imports that one before it
parses `--help`, and the NATS and Redis clients are the slowest imports of all.
"""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from nats.aio.client import Client as NatsClient
from nats.js.client import JetStreamContext

from rlfleet.common.config import ServiceConfig
from rlfleet.common.redis_store import connect_redis
from rlfleet.common.service import App
from rlfleet.common.streams import connect_nats, ensure_streams


class PeersApp(App):
    """An app that connects to NATS (ensuring the streams) and/or Redis before serving.

    Subclasses set `uses_nats`/`uses_redis` and read `self.nc`, `self.js`, `self.redis`.
    """

    uses_nats = False
    uses_redis = False

    def __init__(self, config: ServiceConfig, name: str) -> None:
        self.config = config
        self.name = name
        # Set by connect(), for the peers the subclass uses.
        self.nc: NatsClient | None = None
        self.js: JetStreamContext | None = None
        self.redis: aioredis.Redis | None = None

    async def connect(self) -> None:
        if self.uses_redis:
            self.redis = await connect_redis(self.config.redis)  # type: ignore[attr-defined]
        if self.uses_nats:
            self.nc = await connect_nats(self.config.nats, self.name)  # type: ignore[attr-defined]
            self.js = js = self.nc.jetstream()
            await ensure_streams(js)

    async def stop(self) -> None:
        if self.nc is not None:
            try:
                await asyncio.wait_for(self.nc.drain(), 3.0)
            except (TimeoutError, Exception):  # NATS gone already: nothing left to flush
                await self.nc.close()
        if self.redis is not None:
            await self.redis.aclose()
