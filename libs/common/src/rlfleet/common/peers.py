"""An App that connects to NATS (ensuring the streams) and/or Redis before serving.

Apart from `rlfleet.common.service` because a service's entry point imports that one before it
parses `--help`, and the NATS and Redis clients are the slowest imports of all.
"""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from nats.aio.client import Client as NatsClient
from nats.js.client import JetStreamContext

from rlfleet.common import revocations, security
from rlfleet.common.config import ServiceConfig
from rlfleet.common.errors import StartupError
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
        self._revocations: asyncio.Task[None] | None = None

    async def connect(self) -> None:
        if self.uses_redis:
            self.redis = await connect_redis(self.config.redis)  # type: ignore[attr-defined]
            self._watch_revocations(self.redis)
        if self.uses_nats:
            self.nc = await connect_nats(self.config.nats, self.name)  # type: ignore[attr-defined]
            self.js = js = self.nc.jetstream()
            await ensure_streams(js)

    def _watch_revocations(self, client: aioredis.Redis) -> None:
        """A serving process with the run's token book follows the run's revocations in Redis."""
        if security.plaintext():
            return
        try:
            book = security.local_credentials().book
        except StartupError:
            return
        if book is not None:
            self._revocations = asyncio.create_task(revocations.watch(client, self.config.run_id, book),
                                                    name="revocations")

    def connected_redis(self) -> aioredis.Redis:
        """`self.redis` once connect() ran, for an app with `uses_redis`: a component that needs Redis
        gets a client, not an Optional that every one of its calls would have to check."""
        if self.redis is None:
            raise RuntimeError(
                f"{self.name}: Redis is not connected (set uses_redis and call connect() first)"
            )
        return self.redis

    def connected_js(self) -> JetStreamContext:
        """`self.js` once connect() ran, for an app with `uses_nats` (as connected_redis)."""
        if self.js is None:
            raise RuntimeError(f"{self.name}: NATS is not connected (set uses_nats and call connect() first)")
        return self.js

    async def stop(self) -> None:
        if self._revocations is not None:
            self._revocations.cancel()
        if self.nc is not None:
            try:
                await asyncio.wait_for(self.nc.drain(), 3.0)
            except (TimeoutError, Exception):  # NATS gone already: nothing left to flush
                await self.nc.close()
        if self.redis is not None:
            await self.redis.aclose()
