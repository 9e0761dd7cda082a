"""A session's state and the pure operations on it: append a span, build the trajectory.

The token state is a `rlfleet.session.v1.Session` (token IDs, rollout log-probs, loss mask, spans);
the rest (sampling defaults, timings, counters, close bookkeeping) sits beside it. Invariants kept
here: the three per-token lists have the same length, spans tile [0, len), the loss mask is 1
exactly on GENERATED spans, and log-probs are 0 everywhere else.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.gateway.v1 import gateway_pb2
from rlfleet.api.session.v1 import session_pb2

SCHEMA_VERSION = common_pb2.SCHEMA_VERSION_1
OPEN, CLOSED, ABORTED = (session_pb2.SESSION_STATE_OPEN, session_pb2.SESSION_STATE_CLOSED,
                         session_pb2.SESSION_STATE_ABORTED)


@dataclass
class SessionState:
    session: session_pb2.Session
    sampling: common_pb2.SamplingParams = field(default_factory=common_pb2.SamplingParams)
    group_size: int = 0
    suite: str = ""
    split: str = ""
    opened_ms: int = 0
    generate_s: float = 0.0
    tool_wait_s: float = 0.0
    last_generate_end: float = 0.0  # unix time the last generate returned; 0 once an observation used it
    num_turns: int = 0
    num_observations: int = 0
    budget_exhausted: bool = False
    expired: bool = False  # closed by the server after session_idle_timeout_s without a call
    owner: str = ""  # the principal that opened it (security.Principal.owner); only it (and services) see it
    # Close bookkeeping (the exactly-once state machine; see store.py).
    rev: int = 0
    trajectory: bytes = b""
    published: bool = False
    released: bool = False

    @property
    def session_id(self) -> str:
        return self.session.session_id

    @property
    def total_tokens(self) -> int:
        return len(self.session.token_ids)

    @property
    def remaining(self) -> int:
        return self.session.max_total_tokens - self.total_tokens

    @property
    def state_name(self) -> str:
        return session_pb2.SessionState.Name(self.session.state).removeprefix("SESSION_STATE_").lower()

    # --- storage form ---------------------------------------------------------------------------
    def fields(self, with_sampling: bool = True) -> dict[str, bytes]:
        info = {"group_size": self.group_size, "suite": self.suite, "split": self.split,
                "opened_ms": self.opened_ms, "generate_s": self.generate_s, "tool_wait_s": self.tool_wait_s,
                "last_generate_end": self.last_generate_end, "num_turns": self.num_turns,
                "num_observations": self.num_observations, "budget_exhausted": self.budget_exhausted,
                "expired": self.expired}
        fields = {"session": self.session.SerializeToString(), "info": json.dumps(info).encode(),
                  "trajectory": self.trajectory, "owner": self.owner.encode()}
        if with_sampling:
            fields["sampling"] = self.sampling.SerializeToString()
        return fields

    @classmethod
    def from_fields(cls, raw: dict[bytes, bytes]) -> SessionState:
        info = json.loads(raw[b"info"])
        return cls(
            session=session_pb2.Session.FromString(raw[b"session"]),
            sampling=common_pb2.SamplingParams.FromString(raw[b"sampling"]), **info,
            rev=int(raw.get(b"rev", b"0")), trajectory=raw.get(b"trajectory", b""),
            owner=raw.get(b"owner", b"").decode(),
            published=raw.get(b"published") == b"1", released=raw.get(b"released") == b"1")


def append_prompt(state: SessionState, ids: list[int]) -> None:
    _append(state, ids, None, common_pb2.Span(kind=common_pb2.SPAN_KIND_PROMPT, policy_version=-1))


def append_generated(state: SessionState, reply: gateway_pb2.GenerateResponse, finished_at: float) -> int:
    """Appends the engine's reply as a GENERATED span (loss mask 1); returns the span index."""
    span = common_pb2.Span(kind=common_pb2.SPAN_KIND_GENERATED, policy_version=reply.policy_version,
                           finish_reason=reply.finish_reason, engine_id=reply.engine_id,
                           latency_s=reply.latency_s)
    logprobs = list(reply.output_logprobs)
    if len(logprobs) != len(reply.output_ids):
        raise ValueError(f"the engine returned {len(logprobs)} log-probs for {len(reply.output_ids)} tokens")
    # The reply's per-token versions, moved to trajectory offsets: a turn that crossed a weight swap
    # keeps both versions (policy_version, the oldest, is what staleness is counted by). Set before
    # _append, which stores a copy of the span.
    offset = len(state.session.token_ids)
    span.version_ranges.extend(
        common_pb2.VersionRange(policy_version=r.policy_version, start=offset + r.start, end=offset + r.end)
        for r in reply.version_ranges)
    if not reply.version_ranges and reply.output_ids:  # a gateway that sends none: one range
        span.version_ranges.add(policy_version=reply.policy_version, start=offset,
                                end=offset + len(reply.output_ids))
    index = _append(state, list(reply.output_ids), logprobs, span)
    state.session.engine_id = reply.engine_id
    state.generate_s += reply.latency_s
    state.last_generate_end = finished_at
    state.num_turns += 1
    if state.remaining <= 0:
        state.budget_exhausted = True
    return index


def append_observation(state: SessionState, ids: list[int], now: float) -> tuple[int, float]:
    """Appends an observation (loss mask 0); returns (span index, tool wait since the last generate)."""
    wait = max(0.0, now - state.last_generate_end) if state.last_generate_end else 0.0
    span = common_pb2.Span(kind=common_pb2.SPAN_KIND_OBSERVATION, policy_version=-1, latency_s=wait)
    index = _append(state, ids, None, span)
    state.tool_wait_s += wait
    state.last_generate_end = 0.0  # the next observation waited on nothing new
    state.num_observations += 1
    if state.remaining <= 0:
        state.budget_exhausted = True
    return index, wait


def _append(state: SessionState, ids: list[int], logprobs: list[float] | None, span: common_pb2.Span) -> int:
    session = state.session
    span.start = len(session.token_ids)
    span.end = span.start + len(ids)
    generated = span.kind == common_pb2.SPAN_KIND_GENERATED
    session.token_ids.extend(ids)
    session.rollout_logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
    session.loss_mask.extend([1 if generated else 0] * len(ids))
    session.spans.append(span)
    return len(session.spans) - 1


def build_trajectory(state: SessionState, trajectory_id: str, status: common_pb2.TrajectoryStatus,
                     verdict: common_pb2.Verdict | None, metadata: dict[str, str]) -> common_pb2.Trajectory:
    """The session as one Trajectory; the server's TRUNCATED overrides a client's COMPLETED when the
    budget ran out."""
    if status in (common_pb2.TRAJECTORY_STATUS_UNSPECIFIED, common_pb2.TRAJECTORY_STATUS_COMPLETED):
        status = (common_pb2.TRAJECTORY_STATUS_TRUNCATED if state.budget_exhausted
                  else common_pb2.TRAJECTORY_STATUS_COMPLETED)
    session = state.session
    closed_ms = int(time.time() * 1000)
    timings = common_pb2.Timings(
        generate_s=state.generate_s, tool_wait_s=state.tool_wait_s,
        verify_s=verdict.verify_s if verdict is not None else 0.0,
        wall_s=max(0.0, (closed_ms - state.opened_ms) / 1000), opened_unix_ms=state.opened_ms,
        closed_unix_ms=closed_ms)
    trajectory = common_pb2.Trajectory(
        schema_version=SCHEMA_VERSION, trajectory_id=trajectory_id, run_id=session.run_id,
        task_id=session.task_id,
        group_id=session.group_id, sample_index=session.sample_index, group_size=state.group_size,
        session_id=session.session_id, token_ids=session.token_ids, rollout_logprobs=session.rollout_logprobs,
        loss_mask=session.loss_mask, spans=session.spans, status=status, timings=timings,
        num_turns=state.num_turns, num_observations=state.num_observations,
        metadata={**session.metadata, **metadata}, suite=state.suite, split=state.split)
    if verdict is not None:
        trajectory.verdict.CopyFrom(verdict)
    return trajectory
