"""Version announcements from the POLICY stream: a durable pull consumer, acked once handled.

A message the broker can never accept (not a PolicyVersion, another schema, a URI outside the
store, a version the store lacks) is logged and terminated, so it is not redelivered forever; a
failure of the broker's own dependencies (Redis) is nak'ed and retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from google.protobuf.message import DecodeError
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.client import JetStreamContext

from rlfleet.api.common.v1 import common_pb2
from rlfleet.common.errors import RlfleetError
from rlfleet.common.streams import SCHEMA_HEADER, SCHEMA_VERSION, durable_name, ensure_consumer

log = logging.getLogger(__name__)


class PolicyConsumer:
    def __init__(
        self, js: JetStreamContext, run_id: str,
        handle: Callable[[common_pb2.PolicyVersion], Awaitable[object]]
    ) -> None:
        self.js = js
        self.run_id = run_id
        self.handle = handle
        self.durable = durable_name("weight-broker", run_id)
        self._task: asyncio.Task | None = None
        self._subscription: JetStreamContext.PullSubscription | None = None

    async def start(self) -> None:
        await ensure_consumer(self.js, "POLICY", self.durable, self.run_id, ack_wait_s=120.0)
        self._subscription = await self.js.pull_subscribe_bind(self.durable, "POLICY")
        self._task = asyncio.create_task(self._run(self._subscription), name="policy-consumer")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._subscription is not None:
            # Unacked messages are redelivered to the next broker; a drain would wait on the fetch.
            with contextlib.suppress(NatsError):
                await self._subscription.unsubscribe()

    async def _run(self, subscription) -> None:
        while True:
            try:
                messages = await subscription.fetch(16, timeout=1.0)
            except (TimeoutError, NatsTimeoutError):
                continue
            except Exception as exc:  # NATS reconnecting: the client retries by itself
                log.warning("POLICY fetch failed: %s", exc)
                await asyncio.sleep(1.0)
                continue
            for message in messages:
                await self._one(message)

    async def _one(self, message) -> None:
        schema = (message.headers or {}).get(SCHEMA_HEADER, SCHEMA_VERSION)
        try:
            if schema != SCHEMA_VERSION:
                raise ValueError(f"schema {schema!r}")
            version = common_pb2.PolicyVersion.FromString(message.data)
        except (DecodeError, ValueError) as exc:
            log.error("dropping an unreadable POLICY message: %s", exc)
            await message.term()
            return
        try:
            await self.handle(version)
        except RlfleetError as exc:
            log.error("dropping POLICY announcement of version %d: %s", version.version, exc)
            await message.term()
            return
        except Exception:
            log.exception("handling POLICY announcement of version %d failed; redelivering", version.version)
            await message.nak(delay=1.0)
            return
        await message.ack()
