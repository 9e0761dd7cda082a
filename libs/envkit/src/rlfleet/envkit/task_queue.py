"""The TASKS work queue as a rollout worker sees it: deliveries to settle, heartbeats, dead letters.

One durable pull consumer per run (`durable_name(consumer, run_id)`), shared by every worker, with
explicit acks. A delivery is settled exactly one way:

- `ack()`: every sample of its group is published;
- `retry_later()`: not finished (a peer was down, the worker is stopping): redelivered after a delay;
- `dead_letter(reason)`: it can never run (undecodable, unknown suite) or it used up `max_deliver`;
  the raw message goes to the TASKS_DEAD stream (`rlfleet.<run>.tasks_dead`) with the reason, and
  is terminated on TASKS. Nothing is dropped silently.

While a group runs, `heartbeat()` sends in-progress acks so that `ack_wait` can stay short and a
dead worker's task is redelivered soon. A task whose last delivery died with its worker is caught by
`MaxDeliveriesWatch` (JetStream's MAX_DELIVERIES advisory) and dead-lettered from the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import nats
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.client import JetStreamContext
from nats.js.errors import BadRequestError, NotFoundError

from rlfleet.common.streams import MSG_ID_HEADER, durable_name, ensure_consumer

log = logging.getLogger(__name__)

TASKS = "TASKS"
DEAD_LETTER_STREAM = "TASKS_DEAD"
DEAD_LETTER_SUFFIX = "tasks_dead"
REASON_HEADER = "Rlfleet-Dead-Reason"
DELIVERIES_HEADER = "Rlfleet-Deliveries"
SEQUENCE_HEADER = "Rlfleet-Task-Sequence"


def dead_letter_subject(run_id: str) -> str:
    return f"rlfleet.{run_id}.{DEAD_LETTER_SUFFIX}"


async def ensure_dead_letter_stream(js: JetStreamContext) -> None:
    config = StreamConfig(name=DEAD_LETTER_STREAM, subjects=[f"rlfleet.*.{DEAD_LETTER_SUFFIX}"],
                          retention=RetentionPolicy.LIMITS, storage=StorageType.FILE,
                          max_age=30 * 24 * 3600.0, duplicate_window=120.0)
    try:
        await js.add_stream(config)
    except BadRequestError:
        await js.update_stream(config)


@dataclass
class Delivery:
    """One delivery of a TASKS message."""

    msg: Msg
    queue: TaskQueue

    @property
    def sequence(self) -> int:
        return self.msg.metadata.sequence.stream

    @property
    def number(self) -> int:
        """1 for the first delivery, 2 for the first redelivery, ..."""
        return self.msg.metadata.num_delivered

    @property
    def last_chance(self) -> bool:
        return self.number >= self.queue.max_deliver

    async def ack(self) -> None:
        try:
            await self.msg.ack_sync(timeout=5.0)
        except (NatsError, TimeoutError) as exc:  # a lost ack means a redelivery, which finds the group done
            log.warning("ack of task #%d not confirmed: %s", self.sequence, exc or type(exc).__name__)

    async def retry_later(self, delay_s: float) -> None:
        await self.msg.nak(delay=delay_s or None)

    async def dead_letter(self, reason: str) -> None:
        await self.queue.publish_dead(self.msg.data, reason, self.sequence, self.number)
        await self.msg.term()

    @contextlib.asynccontextmanager
    async def heartbeat(self, every_s: float) -> AsyncIterator[None]:
        """Keeps the delivery in progress while the block runs."""

        async def beat() -> None:
            while True:
                await asyncio.sleep(every_s)
                with contextlib.suppress(NatsError, TimeoutError):
                    await self.msg.in_progress()

        task = asyncio.create_task(beat())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class TaskQueue:
    def __init__(self, js: JetStreamContext, run_id: str, consumer: str, *, ack_wait_s: float,
                 max_deliver: int) -> None:
        self.js = js
        self.run_id = run_id
        self.durable = durable_name(consumer, run_id)
        self.ack_wait_s = ack_wait_s
        self.max_deliver = max_deliver
        self._sub: JetStreamContext.PullSubscription | None = None

    async def start(self) -> None:
        await ensure_dead_letter_stream(self.js)
        await ensure_consumer(self.js, TASKS, self.durable, self.run_id, ack_wait_s=self.ack_wait_s,
                              max_deliver=self.max_deliver)
        info = await self.js.consumer_info(TASKS, self.durable)
        if info.config.max_deliver and info.config.max_deliver > 0:
            self.max_deliver = info.config.max_deliver  # the consumer's own setting (first worker's) rules
        self._sub = await self.js.pull_subscribe_bind(self.durable, TASKS)

    async def next(self, timeout_s: float) -> Delivery | None:
        """The next delivery, or None when none came within `timeout_s`."""
        assert self._sub is not None, "start() first"
        try:
            (msg,) = await self._sub.fetch(1, timeout=timeout_s)
        except (NatsTimeoutError, TimeoutError):
            return None
        except NatsError as exc:  # NATS restarting: the client reconnects by itself; ask again shortly
            log.warning("fetching a task failed (%s); trying again", exc or type(exc).__name__)
            await asyncio.sleep(min(timeout_s, 0.5))
            return None
        return Delivery(msg, self)

    async def publish_dead(self, data: bytes, reason: str, sequence: int, deliveries: int) -> None:
        headers = {REASON_HEADER: reason[:1000], DELIVERIES_HEADER: str(deliveries),
                   SEQUENCE_HEADER: str(sequence), MSG_ID_HEADER: f"dead-{self.run_id}-{sequence}"}
        await self.js.publish(dead_letter_subject(self.run_id), data, headers=headers, timeout=5.0)
        log.error("task #%d dead-lettered after %d deliveries: %s", sequence, deliveries, reason)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(NatsError, TimeoutError):
                await self._sub.unsubscribe()
            self._sub = None


class MaxDeliveriesWatch:
    """Dead-letters a task whose last delivery was lost with its worker (so it is never redelivered)."""

    def __init__(self, nc: nats.NATS, queue: TaskQueue) -> None:
        self.nc = nc
        self.queue = queue
        self._sub: Subscription | None = None

    async def start(self) -> None:
        topic = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{TASKS}.{self.queue.durable}"
        self._sub = await self.nc.subscribe(topic, cb=self._on_advisory)

    async def _on_advisory(self, msg) -> None:
        try:
            sequence = int(json.loads(msg.data)["stream_seq"])
            stored = await self.queue.js.get_msg(TASKS, sequence)
        except NotFoundError:
            return  # settled meanwhile, or another worker moved it already
        except (ValueError, KeyError, NatsError, TimeoutError) as exc:
            log.warning("max-deliveries advisory not handled: %s", exc or type(exc).__name__)
            return
        reason = f"no worker finished it in {self.queue.max_deliver} deliveries (the last one was lost)"
        await self.queue.publish_dead(stored.data or b"", reason, sequence, self.queue.max_deliver)
        with contextlib.suppress(NotFoundError, NatsError):
            await self.queue.js.delete_msg(TASKS, sequence)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(NatsError):
                await self._sub.unsubscribe()
            self._sub = None

