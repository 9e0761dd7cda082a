"""The agent loop: one episode of one task, from a fresh sandbox to a published trajectory.

    open the session, its first turn generated in the same call (admission refusals retried), and
    create the sandbox (unless the tools run in-process)
    until a final answer, max_turns + 1 turns, the token budget or the time limit:
        Generate (with the last observation) -> parse the turn's first tag -> run the tool in the sandbox
    Verify (the verifier reads the session and sandbox itself; the client never gives a reward)
    CloseSession (COMPLETED, or TRUNCATED when a budget ran out) -> the trajectory is published
    DestroySandbox, always; on an environment failure the session is closed FAILED instead

Usage:

    loop = AgentLoop(clients)
    summary = await loop.run(EpisodeSpec(task=task_message, session_id="t1-0-s0"))
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from opentelemetry import trace

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.session.v1 import session_pb2
from rlfleet.envkit.actions import (
    FinalAnswer,
    InvalidCall,
    NoAction,
    ToolCall,
    parse_action,
    too_many_calls_error,
)
from rlfleet.envkit.sdk.clients import Clients, chat_messages
from rlfleet.envkit.sdk.environment import (
    Environment,
    SandboxHandle,
    ToolResult,
    UnknownSuite,
    environment_for,
    needs_sandbox,
)
from rlfleet.envkit.sdk.errors import (
    Backpressure,
    EpisodeError,
    PeerUnavailable,
    RequestRejected,
    RpcError,
    RpcNotFound,
    Superseded,
)
from rlfleet.envkit.sdk.framing import ChatMLFraming, TurnFraming
from rlfleet.envkit.sdk.retry import Backoff, retry
from rlfleet.envkit.sdk.summary import (
    END_ANSWER,
    END_BUDGET,
    END_CANCELLED,
    END_ERROR,
    END_NO_ACTION,
    END_TIMEOUT,
    END_TURN_LIMIT,
    EpisodeSummary,
)

log = logging.getLogger(__name__)
# The API's tracer: a no-op until the process sets up telemetry (rlfleet.common.telemetry), so an
# environment that traces nothing pays nothing.
tracer = trace.get_tracer("rlfleet.envkit")

COMPLETED = common_pb2.TRAJECTORY_STATUS_COMPLETED
TRUNCATED = common_pb2.TRAJECTORY_STATUS_TRUNCATED
FAILED = common_pb2.TRAJECTORY_STATUS_FAILED
ABORTED = common_pb2.TRAJECTORY_STATUS_ABORTED
DEFAULT_TOOL_TIMEOUT_S = 10.0
DEFAULT_EPISODE_TIMEOUT_S = 60.0
CLEANUP_TIMEOUT_S = 10.0
CLOSE_RETRY = Backoff(first_s=0.2, max_s=2.0, give_up_after_s=20.0)


@dataclass(frozen=True)
class EpisodeSpec:
    """One sample of a task: the task's public view (a `rlfleet.common.v1.Task`) and its identity."""

    task: common_pb2.Task
    session_id: str
    group_id: str = ""
    sample_index: int = 0
    group_size: int = 1
    sampling: common_pb2.SamplingParams | None = None  # default: the task's
    max_total_tokens: int = 0  # 0: the session server's default budget
    metadata: Mapping[str, str] = field(default_factory=dict)

    @property
    def max_turns(self) -> int:
        return self.task.max_turns

    @property
    def timeout_s(self) -> float:
        return self.task.episode_timeout_s or DEFAULT_EPISODE_TIMEOUT_S

    @property
    def tool_timeout_s(self) -> float:
        try:
            return float(self.task.metadata.get("tool_timeout_s", DEFAULT_TOOL_TIMEOUT_S))
        except ValueError:
            return DEFAULT_TOOL_TIMEOUT_S


@dataclass
class EpisodeHooks:
    """Called as the episode goes (metrics, logs); each must be cheap and must not raise."""

    on_admission_retry: Callable[[BaseException], None] | None = None
    on_tool_result: Callable[[ToolCall, ToolResult, float], None] | None = None


class AgentLoop:
    """Runs episodes against the services; one instance serves many concurrent episodes."""

    def __init__(self, clients: Clients, *, environments: Callable[[str], Environment] = environment_for,
                 framing: Callable[[], TurnFraming] = ChatMLFraming, admission: Backoff | None = None,
                 hooks: EpisodeHooks | None = None, tool_call_format: str = "tags") -> None:
        self.clients = clients
        self.tool_call_format = tool_call_format
        self.environments = environments
        self.framing = framing
        self.admission = admission or Backoff()
        self.hooks = hooks or EpisodeHooks()

    async def run(self, spec: EpisodeSpec) -> EpisodeSummary:
        """Runs the episode to its end and returns its summary; raises only when cancelled, or
        `Superseded` when another worker took the session over (it aborted it).

        The episode is one trace: this span is its root, and every RPC below continues it."""
        episode = _Episode(self, spec)
        with tracer.start_as_current_span("episode", attributes=_span_attributes(spec)) as span:
            try:
                await episode.open()
                await episode.play()
                await episode.verify()
                await episode.close()
            except asyncio.CancelledError:
                await _shielded(episode.abort("cancelled"))
                raise
            except Superseded:
                raise
            except Exception as exc:  # the environment failed: the trajectory says so, the caller goes on
                await _shielded(episode.fail(exc))
            finally:
                await _shielded(episode.destroy_sandbox())
                summary = episode.summary
                span.set_attributes({"rlfleet.end": summary.end, "rlfleet.turns": summary.turns,
                                     "rlfleet.tool_calls": summary.tool_calls,
                                     "rlfleet.trajectory_id": summary.trajectory_id or ""})
        return episode.summary


class _Episode:
    """The state of one running episode; each step is one method."""

    def __init__(self, loop: AgentLoop, spec: EpisodeSpec) -> None:
        self.loop = loop
        self.spec = spec
        self.task = spec.task
        self.session = loop.clients.session
        self.framing = loop.framing()
        self.environment = loop.environments(self.task.suite)
        self.sandbox: SandboxHandle | None = None
        self.opened = False
        self.started = time.monotonic()
        # The first turn, generated by the OpenSession call itself (None: a Generate makes it).
        self.first_turn: session_pb2.GenerateResponse | None = None
        self._open_started = self.started
        self.summary = EpisodeSummary(spec.session_id, self.task.task_id, self.task.suite, spec.group_id,
                                      spec.sample_index)

    # -- open ---------------------------------------------------------------------------------

    async def open(self) -> None:
        missing = sorted(set(self.task.tools) - set(self.environment.tools))
        if missing:
            raise EpisodeError(f"the {self.task.suite} environment cannot run tools {missing}")
        # The session first: admission may make us wait, and a waiting episode should not hold a sandbox.
        reply = await retry(self._open_session, self.loop.admission,
                            on_retry=self.loop.hooks.on_admission_retry)
        self.opened = True
        self.framing.learn_prompt(reply.prompt_token_ids)
        if reply.HasField("first_turn"):
            self.first_turn = reply.first_turn
            self.summary.generate_s += time.monotonic() - self._open_started
            # The time limit counts from admission: from the call that was admitted, which
            # generated the first turn.
            self.started = self._open_started
        else:
            self.started = time.monotonic()  # the time limit counts from admission
        if not needs_sandbox(self.environment):  # in-process tools: nothing to isolate, nothing to create
            await self.environment.setup(None, self.task)
            return
        labels = {"run_id": self.task.run_id, "task_id": self.task.task_id,
                  "session_id": self.spec.session_id}
        # With the session open (holding an admission slot), waiting for a sandbox is bounded tighter.
        sandbox_wait = replace(self.loop.admission,
                               give_up_after_s=min(self.loop.admission.give_up_after_s, 60.0))
        started = time.monotonic()
        created = await retry(
            lambda: self.loop.clients.sandbox.create(self.spec.session_id, labels,
                                                     ttl_s=2 * self.spec.timeout_s + 300),
            sandbox_wait, on_retry=self.loop.hooks.on_admission_retry)
        self.sandbox = SandboxHandle(self.loop.clients.sandbox, created.sandbox_id, self.spec.tool_timeout_s)
        self.summary.sandbox_id = created.sandbox_id
        await self.environment.setup(self.sandbox, self.task)
        self.summary.sandbox_s += time.monotonic() - started

    async def _open_session(self) -> session_pb2.OpenSessionResponse:
        spec, task = self.spec, self.task
        self._open_started = time.monotonic()
        # The first turn comes with the open (one round trip less); the model's first turn needs
        # nothing the sandbox below holds.
        request = session_pb2.OpenSessionRequest(first_turn=True,
            session_id=spec.session_id, run_id=task.run_id, task_id=task.task_id, group_id=spec.group_id,
            sample_index=spec.sample_index, group_size=spec.group_size,
            messages=chat_messages([{"role": m.role, "content": m.content} for m in task.messages]),
            sampling=spec.sampling if spec.sampling is not None else task.sampling,
            max_total_tokens=spec.max_total_tokens, metadata=dict(spec.metadata), suite=task.suite,
            split=task.split)
        return await self.session.open(request)

    # -- turns ----------------------------------------------------------------------------------

    async def play(self) -> None:
        remaining = self.spec.timeout_s - (time.monotonic() - self.started)
        try:
            self.summary.end = await asyncio.wait_for(self._turns(), max(remaining, 0.001))
        except TimeoutError:
            self.summary.end = END_TIMEOUT

    async def _turns(self) -> str:
        tools, calls = list(self.task.tools), 0
        # Framed; it goes with the next Generate (one round trip a turn).
        observation: str | session_pb2.AppendObservationRequest | None = None
        for turn in range(self.spec.max_turns + 1):
            reply = await self._generate(observation)
            if reply is None:
                return END_BUDGET
            action = parse_action(self._parsed_text(reply), tools, self.loop.tool_call_format)
            if isinstance(action, FinalAnswer):
                self.summary.final_answer = action.answer
                return END_ANSWER
            if isinstance(action, NoAction):
                return END_NO_ACTION
            if reply.budget_exhausted:
                return END_BUDGET
            last_turn = turn == self.spec.max_turns
            if isinstance(action, ToolCall):
                calls += 1
                if calls > self.spec.max_turns:
                    self.summary.invalid_calls += 1
                    if last_turn:
                        return END_TURN_LIMIT
                    result = too_many_calls_error(self.spec.max_turns)
                else:
                    result = await self._run_tool(action)
            else:
                assert isinstance(action, InvalidCall)
                self.summary.invalid_calls += 1
                result = action.error
            if last_turn:
                return END_TURN_LIMIT  # nobody would read another observation
            observation = self.framing.observation(reply, result)
        return END_TURN_LIMIT

    def _parsed_text(self, reply: session_pb2.GenerateResponse) -> str:
        """The text tool calls are parsed from: the built-in tags read the plain text (as the verifier
        does); other formats read the tokens with special tokens kept ([TOOL_CALLS] is one)."""
        if self.loop.tool_call_format == "tags":
            return reply.text
        return reply.text_with_special_tokens or reply.text

    async def _generate(self, observation: str | session_pb2.AppendObservationRequest | None,
                        ) -> session_pb2.GenerateResponse | None:
        """The next turn, with `observation` appended first in the same call; None when the observation
        does not fit the session's token budget or leaves no room for a turn."""
        if observation is None and self.first_turn is not None:  # generated by the OpenSession call
            reply, self.first_turn = self.first_turn, None
            self.summary.turns += 1
            return reply
        started = time.monotonic()
        try:
            reply = await self._session_call(
                self.session.generate(self.spec.session_id, observation=observation))
        except RequestRejected as exc:
            if observation is not None and exc.error.reason == "OBSERVATION_OVER_BUDGET":
                return None
            raise
        self.summary.generate_s += time.monotonic() - started
        if observation is not None and reply.budget_exhausted and not reply.token_ids:
            return None
        self.summary.turns += 1
        return reply

    async def _run_tool(self, call: ToolCall) -> str:
        started = time.monotonic()
        with tracer.start_as_current_span("tool", attributes={"rlfleet.tool": call.tool}) as span:
            result = await self.environment.run_tool(self.sandbox, call)
            span.set_attribute("rlfleet.tool_ok", result.ok)
        waited = time.monotonic() - started
        self.summary.tool_wait_s += waited
        self.summary.tool_calls += 1
        self.summary.tools[call.tool] = self.summary.tools.get(call.tool, 0) + 1
        self.summary.invalid_calls += 0 if result.ok else 1
        self.summary.violations.extend(result.violations)
        if self.loop.hooks.on_tool_result is not None:
            self.loop.hooks.on_tool_result(call, result, waited)
        return result.observation

    async def _session_call(self, call):
        """A session RPC; a session that another worker aborted raises `Superseded`."""
        try:
            return await call
        except (RequestRejected, RpcNotFound) as exc:
            state = await self.session.get(self.spec.session_id)
            if state is not None and state.state == session_pb2.SESSION_STATE_ABORTED:
                self.opened = False
                raise Superseded(f"session {self.spec.session_id} was aborted by another worker") from exc
            raise

    # -- verify, close ------------------------------------------------------------------------------

    async def verify(self) -> None:
        sandbox_id = self.sandbox.sandbox_id if self.sandbox is not None else ""
        started = time.monotonic()
        verdict = await self.loop.clients.verifier.verify(self.spec.session_id, self.task.suite,
                                                          self.task.task_id, sandbox_id)
        self.summary.verify_s = time.monotonic() - started
        self.summary.apply_verdict(verdict)

    async def close(self) -> None:
        status = COMPLETED if self.summary.end in (END_ANSWER, END_NO_ACTION) else TRUNCATED
        # A close is idempotent (the server publishes once), so one that failed to publish is retried.
        reply = await retry(
            lambda: self._session_call(self.session.close(self.spec.session_id, status,
                                                          {"end": self.summary.end})),
            CLOSE_RETRY, retry_on=(PeerUnavailable,))
        self.opened = False
        self.summary.status = status
        self.summary.trajectory_id = reply.trajectory_id
        if reply.HasField("verdict") and reply.verdict.session_id:
            self.summary.apply_verdict(reply.verdict)
        self._finish()

    # -- failure paths ----------------------------------------------------------------------------

    async def fail(self, exc: Exception) -> None:
        """The environment (not the policy) failed. A lasting failure (a rejected request, a tool the
        environment lacks) closes the session FAILED: published, never trained on, not run again. A
        passing one (a peer down or full) aborts it, so that a redelivery of the task runs it again."""
        self.summary.end, self.summary.error = END_ERROR, _describe(exc)
        # The episode's own sandbox gone before its TTL: its manager restarted (a new one knows no
        # sandbox of its predecessor's). The platform's doing: the sample runs again, not FAILED.
        lost_sandbox = (self.sandbox is not None and isinstance(exc, RpcNotFound)
                        and exc.service == "sandbox")
        self.summary.platform_failure = is_platform_failure(exc) or lost_sandbox
        log.warning("episode %s failed: %s", self.spec.session_id, self.summary.error)
        if self.opened and not (is_transient(exc) or lost_sandbox):
            try:
                reply = await self.session.close(self.spec.session_id, FAILED,
                                                 {"end": END_ERROR, "error": self.summary.error[:500]})
                self.summary.status, self.summary.trajectory_id = FAILED, reply.trajectory_id
                self.opened = False
            except RpcError as close_error:
                log.warning("could not close %s as FAILED: %s", self.spec.session_id, close_error)
        await self.abort(f"environment failure: {self.summary.error}"[:500])

    async def abort(self, reason: str) -> None:
        if self.summary.end != END_ERROR:
            self.summary.end = END_CANCELLED
        if self.opened:
            with contextlib.suppress(RpcError):
                reply = await self.session.abort(self.spec.session_id, reason)
                self.summary.status, self.summary.trajectory_id = ABORTED, reply.trajectory_id
                self.opened = False
        self._finish()

    async def destroy_sandbox(self) -> None:
        if self.sandbox is None:
            return
        started = time.monotonic()
        try:
            await self.loop.clients.sandbox.destroy(self.sandbox.sandbox_id)
        except RpcError as exc:  # its TTL reclaims it; say so, but the episode is over either way
            log.warning("could not destroy sandbox %s: %s", self.sandbox.sandbox_id, exc)
        self.summary.sandbox_s += time.monotonic() - started
        self.sandbox = None

    def _finish(self) -> None:
        self.summary.episode_s = time.monotonic() - self.started


def _span_attributes(spec: EpisodeSpec) -> dict[str, str | int]:
    return {"rlfleet.session_id": spec.session_id, "rlfleet.run_id": spec.task.run_id,
            "rlfleet.task_id": spec.task.task_id, "rlfleet.suite": spec.task.suite,
            "rlfleet.group_id": spec.group_id, "rlfleet.sample_index": spec.sample_index}


async def _shielded(step) -> None:
    """Runs a cleanup step to its end even when the caller is being cancelled, within a deadline."""
    task = asyncio.ensure_future(asyncio.wait_for(step, CLEANUP_TIMEOUT_S))
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await task
        raise
    except Exception as exc:
        log.warning("cleanup step failed: %s", _describe(exc))


def is_platform_failure(exc: BaseException) -> bool:
    """Whether a service being down, restarting or full caused it (UNAVAILABLE, DEADLINE_EXCEEDED,
    RESOURCE_EXHAUSTED, a lost connection): nothing about the task, so it must not count against it."""
    return isinstance(exc, PeerUnavailable | Backpressure | ConnectionError | TimeoutError)


def is_transient(exc: BaseException) -> bool:
    """Whether running the episode again later may succeed (a peer down or full, not a bad request)."""
    return not isinstance(exc, RequestRejected | RpcNotFound | EpisodeError | UnknownSuite)


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


async def run_episode(clients: Clients, spec: EpisodeSpec, **options) -> EpisodeSummary:
    """`AgentLoop(clients, **options).run(spec)` as one call."""
    return await AgentLoop(clients, **options).run(spec)
