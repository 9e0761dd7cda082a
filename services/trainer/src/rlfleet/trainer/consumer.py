"""The trainer's durable pull consumer on the run's TRAJECTORIES subject.

Explicit acks; `max_deliver` unlimited (a trajectory is never given up on: it is either trained,
or dropped with a reason and acked/terminated by the trainer itself). `ack_wait` bounds how long a
message delivered to a trainer that died waits before it is redelivered; the live trainer keeps
everything it holds alive with in-progress acks (see intake.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.client import JetStreamContext
from nats.js.errors import BadRequestError

from rlfleet.common.streams import subject
from rlfleet.trainer.service_config import ConsumerConfig as ConsumerOptions

log = logging.getLogger(__name__)

STREAM = "TRAJECTORIES"


class Delivery(Protocol):
    """One delivered message (a nats `Msg` is one)."""

    data: bytes

    async def ack(self) -> None: ...
    async def term(self) -> None: ...
    async def nak(self, delay: float | None = None) -> None: ...
    async def in_progress(self) -> None: ...


class TrajectoryConsumer:
    def __init__(self, js, run_id: str, name: str, options: ConsumerOptions) -> None:
        self.js = js
        self.run_id = run_id
        self.name = name
        self.options = options
        self._sub: JetStreamContext.PullSubscription | None = None

    async def start(self) -> None:
        """Creates the durable consumer, or updates its ack_wait/max_ack_pending, and binds to it."""
        config = ConsumerConfig(
            durable_name=self.name, ack_policy=AckPolicy.EXPLICIT,
            filter_subject=subject(STREAM, self.run_id), deliver_policy=DeliverPolicy.ALL,
            ack_wait=self.options.ack_wait_s, max_deliver=-1,
            max_ack_pending=self.options.max_ack_pending)
        try:
            await self.js.add_consumer(STREAM, config)
        except BadRequestError as exc:
            # An existing consumer whose immutable settings differ: keep it (its position matters more).
            log.warning("consumer %s exists with other settings (%s); using it as it is", self.name, exc)
        self._sub = await self.js.pull_subscribe_bind(self.name, STREAM)

    async def fetch(self) -> Sequence[Delivery]:
        assert self._sub is not None, "start() first"
        try:
            return await self._sub.fetch(self.options.fetch_batch, timeout=self.options.fetch_timeout_s)
        except (TimeoutError, NatsTimeout):  # nats-py raises the bare one when the deadline passed early
            return []

    async def queue_depth(self) -> int:
        """Messages not yet delivered plus delivered but unacked."""
        info = await self.js.consumer_info(STREAM, self.name, timeout=2.0)
        return int(info.num_pending or 0) + int(info.num_ack_pending or 0)

    async def stop(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except NatsError as exc:  # the connection may be gone already: nothing to release then
                log.debug("unsubscribe: %s", exc)
