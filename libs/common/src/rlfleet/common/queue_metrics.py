"""Queue depths of the loop's JetStream consumers, as Prometheus gauges.

    rlfleet_queue_pending_messages{stream, consumer}      not yet delivered to any consumer
    rlfleet_queue_ack_pending_messages{stream, consumer}  delivered, not yet acked

The process that owns a consumer polls it (the rollout worker TASKS, the trainer TRAJECTORIES), so
the numbers are there wherever that process runs. Gauge callbacks run on the scrape thread and
cannot await NATS, so a background task polls and the callbacks read its last answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

from nats.errors import Error as NatsError
from opentelemetry.metrics import CallbackOptions, Observation

from rlfleet.common.telemetry import meter

log = logging.getLogger(__name__)

# (stream, consumer) -> (pending, ack_pending); one table per process, read by one pair of gauges.
_depths: dict[tuple[str, str], tuple[int, int]] = {}
_registered = False


def _observe(index: int):
    def callback(_options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(depth[index], {"stream": stream, "consumer": consumer})
                for (stream, consumer), depth in list(_depths.items())]
    return callback


def register_queue_gauges() -> None:
    """Creates the two gauges once per process (after telemetry is set up)."""
    global _registered
    if _registered:
        return
    m = meter("rlfleet.queue")
    m.create_observable_gauge("rlfleet_queue_pending_messages", [_observe(0)],
                              description="messages on the stream not yet delivered to the consumer")
    m.create_observable_gauge("rlfleet_queue_ack_pending_messages", [_observe(1)],
                              description="messages delivered to the consumer and not yet acked")
    _registered = True


class QueueDepthPoller:
    """Polls one durable consumer's backlog every `interval_s` while running."""

    def __init__(self, js, stream: str, consumer: str, interval_s: float = 5.0) -> None:
        self.js = js
        self.stream = stream
        self.consumer = consumer
        self.interval_s = interval_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        register_queue_gauges()
        self._task = asyncio.create_task(self._loop(), name=f"queue-depth-{self.stream}")

    async def poll(self) -> tuple[int, int]:
        info = await self.js.consumer_info(self.stream, self.consumer, timeout=2.0)
        depth = (int(info.num_pending or 0), int(info.num_ack_pending or 0))
        _depths[(self.stream, self.consumer)] = depth
        return depth

    async def _loop(self) -> None:
        while True:
            try:
                await self.poll()
            except (TimeoutError, NatsError) as exc:  # NATS away: keep the last figures, try again
                log.debug("queue depth of %s/%s unavailable: %s", self.stream, self.consumer, exc)
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        _depths.pop((self.stream, self.consumer), None)
