"""consume → validate → group → filter: TRAJECTORIES messages in, complete screened groups out.

The intake runs beside the training loop, so the next groups assemble while a step runs. It holds
every message it has not finished with (`held`, by trajectory ID) and keeps them alive with
in-progress acks; a message leaves `held` only when it is

- dropped (invalid: terminated; valid but not trained: acked), with its reason counted, or
- trained *and* in a durable checkpoint (`settle`, called by the loop after the checkpoint).

A redelivery of a held message replaces the held handle (acking the newest delivery is always
valid); a redelivery of a trajectory the checkpointed model has already learned from is acked and
counted as `duplicate`. Nothing in a message can raise out of `admit`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from nats.errors import Error as NatsError

from rlfleet.trainer import startup
from rlfleet.trainer.consumer import Delivery
from rlfleet.trainer.filters import GroupFilters
from rlfleet.trainer.groups import Group, GroupBuffer
from rlfleet.trainer.ledger import TrainedLedger
from rlfleet.trainer.validation import Candidate, Limits, Rejected, decode, validate

log = logging.getLogger(__name__)


@dataclass
class ReadyGroup:
    group_id: str
    members: list[Candidate]


class Intake:
    def __init__(self, consumer, limits: Limits, ledger: TrainedLedger, buffer: GroupBuffer,
                 filters: GroupFilters, version: Callable[[], int], capacity: int, heartbeat_s: float,
                 on_drop: Callable[[str, int], None] = lambda reason, n: None) -> None:
        self.consumer = consumer
        self.limits = limits
        self.ledger = ledger
        self.buffer = buffer
        self.filters = filters
        self.version = version
        self.capacity = capacity
        self.heartbeat_s = heartbeat_s
        self.on_drop = on_drop
        self.held: dict[str, Delivery] = {}
        self.ready: deque[ReadyGroup] = deque()
        self.dropped_by_reason: Counter[str] = Counter()
        self._changed = asyncio.Condition()
        self._paused_since: float | None = None
        self._paused_s = 0.0

    # ------------------------------------------------------------ the consuming side

    async def run(self) -> None:
        """Pulls messages while not paused and short of ready groups; closes timed-out groups."""
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: not self.paused and len(self.ready) < self.capacity)
            try:
                for delivery in await self.consumer.fetch():
                    await self.admit(delivery)
            except NatsError as exc:  # NATS away: the client reconnects by itself; try again shortly
                log.warning("consuming failed, retrying: %s", exc)
                await asyncio.sleep(1.0)
            for group in self.buffer.expire():
                log.info("group timed out", extra={"group_id": group.group_id, "arrived": group.arrived,
                                                   "expected": group.expected})
                await self._close(group)

    async def admit(self, d: Delivery) -> None:
        startup.mark("first_delivery")
        if "first_redelivery" not in startup.passed:
            # A nats Msg knows how often it was delivered; a predecessor's held message comes back > 1.
            metadata = getattr(d, "metadata", None)
            if metadata is not None and metadata.num_delivered > 1:
                startup.mark("first_redelivery")
        try:
            traj = decode(d.data)
        except Rejected as r:
            await self._reject(d, r)
            return
        tid = traj.trajectory_id
        if tid in self.held:
            self.held[tid] = d
            return
        if self.ledger.is_durable(tid):
            self._count("duplicate")
            await d.ack()
            return
        try:
            c = validate(traj, self.limits)
            staleness = self.filters.staleness.of(c, self.version())
            if staleness > self.filters.staleness.max_staleness:
                raise Rejected("stale", f"trajectory {tid}: {staleness} versions behind", invalid=False,
                               trajectory_id=tid, group_id=c.group_id)
            self.held[tid] = d
            group = self.buffer.add(c)
        except Rejected as r:
            self.held.pop(tid, None)
            await self._reject(d, r)
            group = self.buffer.note_dropped(r.group_id, tid, traj.group_size, traj.sample_index,
                                             rerun_expected=r.reason == "aborted")
        if group is not None:
            await self._close(group)

    async def _close(self, group: Group) -> None:
        screened = self.filters.screen(group, self.version())
        await self.drop(screened.dropped)
        if screened.kept:
            async with self._changed:
                self.ready.append(ReadyGroup(group.group_id, screened.kept))
                self._changed.notify_all()

    async def _reject(self, d: Delivery, r: Rejected) -> None:
        self._count(r.reason)
        if r.invalid:
            log.warning("rejected trajectory (%s): %s", r.reason, r.detail, extra={"reason": r.reason})
            await d.term()  # never redelivered
        else:
            await d.ack()

    def _count(self, reason: str, n: int = 1) -> None:
        self.dropped_by_reason[reason] += n
        self.on_drop(reason, n)

    # ------------------------------------------------------------ the training side

    async def take(self, n: int) -> list[ReadyGroup]:
        """The next n ready groups, in the order they completed; waits while paused or short."""
        async with self._changed:
            await self._changed.wait_for(lambda: not self.paused and len(self.ready) >= n)
            groups = [self.ready.popleft() for _ in range(n)]
            self._changed.notify_all()
        return groups

    async def requeue(self, groups: list[ReadyGroup]) -> None:
        async with self._changed:
            self.ready.extendleft(reversed(groups))
            self._changed.notify_all()

    async def drop(self, dropped: list[tuple[Candidate, str]]) -> None:
        for c, reason in dropped:
            self._count(reason)
            d = self.held.pop(c.trajectory_id, None)
            if d is not None:
                await d.ack()

    async def settle(self, trajectory_ids: list[str]) -> None:
        """Acks trained trajectories; call only once a checkpoint that includes them is durable."""
        for tid in trajectory_ids:
            d = self.held.pop(tid, None)
            if d is not None:
                try:
                    await d.ack()
                except NatsError as exc:  # NATS away: the redelivery finds it in the durable ledger
                    log.warning("ack of trained trajectory %s lost: %s", tid, exc)

    # ------------------------------------------------------------ pause, keep-alive, release

    @property
    def paused(self) -> bool:
        return self._paused_since is not None

    @property
    def paused_s(self) -> float:
        extra = time.monotonic() - self._paused_since if self._paused_since is not None else 0.0
        return self._paused_s + extra

    async def pause(self) -> None:
        async with self._changed:
            if self._paused_since is None:
                self._paused_since = time.monotonic()
            self._changed.notify_all()

    async def resume(self) -> None:
        async with self._changed:
            if self._paused_since is not None:
                self._paused_s += time.monotonic() - self._paused_since
                self._paused_since = None
            self._changed.notify_all()

    async def keep_alive(self) -> None:
        """Resets the ack timer of every held message, every heartbeat_s."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            for d in list(self.held.values()):
                try:
                    await d.in_progress()
                except NatsError as exc:  # a reconnecting client: the next round retries; redelivery is safe
                    log.warning("in-progress ack failed: %s", exc)
                    break

    async def release(self) -> None:
        """Hands every held message back for immediate redelivery (at shutdown, after the last checkpoint)."""
        for d in list(self.held.values()):
            try:
                await d.nak()
            except NatsError as exc:  # connection gone: the messages come back after ack_wait instead
                log.warning("nak at shutdown failed: %s", exc)
                break
        self.held.clear()
