"""Closing a session into one published Trajectory, exactly once however often the close is retried.

The state machine, in Redis (see store.py):

    OPEN --(build trajectory, compare-and-set; admission slot and affinity given back in the same
            script, rlfleet.common.session_slots)--> CLOSED|ABORTED + trajectory stored, released=1
         --(publish, Nats-Msg-Id = trajectory_id)--> published=1

A session sealed with released=0 (by a server before this one) is released by the gateway's Release
at its next close, as before.

The trajectory is built and stored before it is published, so a retry after a crash anywhere
re-publishes the same bytes under the same ID (JetStream drops the duplicate inside its window, and
`published` stops a retry after it) and answers the same trajectory_id with published_now=false.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import redis.asyncio as aioredis
from opentelemetry import trace

from rlfleet.api.common.v1 import common_pb2
from rlfleet.common.telemetry import current_trace_context
from rlfleet.common.verdicts import verdict_key
from rlfleet.session.errors import (
    ConcurrentSessionCall,
    GatewayUnavailable,
    PublishFailed,
    SessionNotFound,
    SessionNotOpen,
)
from rlfleet.session.gateway_client import GatewayClient
from rlfleet.session.metrics import SessionMetrics
from rlfleet.session.publisher import TrajectoryPublisher
from rlfleet.session.state import ABORTED, CLOSED, OPEN, SessionState, build_trajectory
from rlfleet.session.store import SessionStore

log = logging.getLogger(__name__)
tracer = trace.get_tracer("rlfleet.session")
ABORTED_STATUS = common_pb2.TRAJECTORY_STATUS_ABORTED
# Trajectory metadata key set on a trajectory closed without a verdict (never trained on).
VERDICT_MISSING = "rlfleet.verdict_missing"


@dataclass(frozen=True)
class Closed:
    trajectory: common_pb2.Trajectory
    published_now: bool


class Closer:
    def __init__(self, store: SessionStore, redis: aioredis.Redis, publisher: TrajectoryPublisher,
                 gateway: GatewayClient, metrics: SessionMetrics) -> None:
        self.store = store
        self.redis = redis
        self.publisher = publisher
        self.gateway = gateway
        self.metrics = metrics

    async def close(self, session_id: str, status: common_pb2.TrajectoryStatus,
                    metadata: dict[str, str]) -> Closed:
        """Closes (or, with status ABORTED, aborts) the session; a retry returns the first close's
        trajectory."""
        for _attempt in range(5):
            # The verdict is read with the session (one round trip); only an open session uses it.
            state, raw_verdict = await self.store.load_with(session_id,
                                                            verdict_key(self.store.run_id, session_id))
            if state.session.state == OPEN:
                verdict = None if raw_verdict is None else common_pb2.Verdict.FromString(raw_verdict)
                try:
                    trajectory = await self._seal(state, status, verdict, metadata)
                except ConcurrentSessionCall:
                    continue  # a turn or another close landed meanwhile: look again
            else:
                trajectory = self._sealed(state, status)
            return Closed(trajectory, await self._deliver(state, trajectory))
        raise ConcurrentSessionCall(f"session {session_id!r} kept changing while it was being closed",
                                    session_id=session_id)

    async def expire(self, session_id: str, idle_s: float) -> bool:
        """Closes an idle open session as expired (ABORTED, abort_reason "expired") and releases its
        admission slot; False when it changed or closed meanwhile."""
        last = await self.store.last_change(session_id)
        if last is None or last > time.time() - idle_s:
            return False
        state = await self.store.load(session_id)
        if state.session.state != OPEN:
            return False
        state.expired = True
        try:
            trajectory = await self._seal(state, ABORTED_STATUS, None, {"abort_reason": "expired"})
        except ConcurrentSessionCall:
            return False  # a call landed meanwhile: not idle after all
        await self._deliver(state, trajectory)
        self.metrics.sessions_expired.add(1)
        log.info("session expired", extra={"session_id": session_id, "idle_s": round(time.time() - last, 1)})
        return True

    async def expire_idle(self, idle_s: float) -> int:
        expired = 0
        for session_id in await self.store.idle_sessions(idle_s):
            try:
                expired += await self.expire(session_id, idle_s)
            except (SessionNotFound, GatewayUnavailable, PublishFailed) as exc:
                log.warning("expiring a session failed", extra={"session_id": session_id, "error": str(exc)})
        return expired

    async def _seal(self, state: SessionState, status: common_pb2.TrajectoryStatus,
                    verdict: common_pb2.Verdict | None, metadata: dict[str, str]) -> common_pb2.Trajectory:
        trajectory = build_trajectory(state, uuid.uuid4().hex, status, verdict, metadata)
        if verdict is None and trajectory.status != ABORTED_STATUS:
            # The trainer trains only on verdicts: say so at close, where the client sees it, rather
            # than leave it to the trainer's rejection log.
            trajectory.metadata[VERDICT_MISSING] = "1"
            self.metrics.verdict_missing.add(1)
            log.warning("trajectory closed without a verdict: it will not be trained on",
                        extra={"session_id": state.session_id})
        # Sealed with the episode's trace (this CloseSession call is part of it), so a retried
        # close republishes the same bytes and the trainer links its step to the right trace.
        trajectory.trace_context.update(current_trace_context())
        state.session.state = ABORTED if trajectory.status == ABORTED_STATUS else CLOSED
        state.session.trajectory_id = trajectory.trajectory_id
        state.trajectory = trajectory.SerializeToString()
        # The same commit gives back the admission slot and the engine affinity (no Release call).
        await self.store.commit(state, release=True)
        return trajectory

    def _sealed(self, state: SessionState, status: common_pb2.TrajectoryStatus) -> common_pb2.Trajectory:
        """The stored trajectory of a finished session, if this call asks for the same ending: a
        retry answers the first close; a close with another status is refused (FAILED_PRECONDITION)."""
        aborting = status == ABORTED_STATUS
        was_aborted = state.session.state == ABORTED
        trajectory = common_pb2.Trajectory.FromString(state.trajectory)
        if state.expired and not aborting:
            raise SessionNotOpen(
                f"cannot close session {state.session_id!r}: it expired (no call for session_idle_timeout_s) "
                f"and was published as aborted (trajectory {state.session.trajectory_id})",
                session_id=state.session_id, state="expired")
        if aborting != was_aborted:
            asked = "abort" if aborting else "close"
            raise SessionNotOpen(
                f"cannot {asked} session {state.session_id!r}: it was already {state.state_name} "
                f"(trajectory {state.session.trajectory_id})", session_id=state.session_id,
                state=state.state_name)
        # COMPLETED (or unset) is what the server turns into TRUNCATED when the budget ran out.
        same = (status == trajectory.status or status == common_pb2.TRAJECTORY_STATUS_UNSPECIFIED
                or (status == common_pb2.TRAJECTORY_STATUS_COMPLETED
                    and trajectory.status == common_pb2.TRAJECTORY_STATUS_TRUNCATED
                    and state.budget_exhausted))
        if not same:
            asked = common_pb2.TrajectoryStatus.Name(status)
            raise SessionNotOpen(
                f"session {state.session_id!r} was already closed as "
                f"{common_pb2.TrajectoryStatus.Name(trajectory.status)}, not {asked} (trajectory "
                f"{trajectory.trajectory_id})", session_id=state.session_id, state=state.state_name)
        return trajectory

    async def _deliver(self, state: SessionState, trajectory: common_pb2.Trajectory) -> bool:
        published_now = False
        # What is done here is recorded in one write at the end: a crash before it only repeats it on the
        # next close (the same bytes under the same Nats-Msg-Id, deduplicated; a release is idempotent).
        # The sealing commit normally gave the admission slot back already (released=1).
        done: list[str] = []
        if not state.published:
            with tracer.start_as_current_span(
                    "TRAJECTORIES publish", kind=trace.SpanKind.PRODUCER,
                    attributes={"messaging.system": "nats", "messaging.destination.name": "TRAJECTORIES",
                                "rlfleet.trajectory_id": trajectory.trajectory_id}) as span:
                # The bytes sealed into the session, published as they are (not serialized again).
                published_now = await self.publisher.publish(trajectory, state.trajectory)
                span.set_attribute("rlfleet.duplicate", not published_now)
            done.append("published")
            if published_now:
                status = (common_pb2.TrajectoryStatus.Name(trajectory.status)
                          .removeprefix("TRAJECTORY_STATUS_"))
                self.metrics.trajectories.add(1, {"status": status.lower()})
                self.metrics.trajectory_tokens.record(len(trajectory.token_ids), {"status": status.lower()})
        if not state.released:
            try:
                await self.gateway.release(state.session_id)
            except GatewayUnavailable as exc:
                # The trajectory is safe; the admission slot is freed by the next close retry or the
                # gateway's lease. Failing the close here would only make the client retry it.
                log.warning("admission release failed",
                            extra={"session_id": state.session_id, "error": exc.message})
                self.metrics.release_failures.add(1)
            else:
                done.append("released")
        if done:
            await self.store.mark(state.session_id, *done)
        return published_now
