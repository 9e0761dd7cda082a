"""SessionService: the RPCs, each a few lines over the session server's components."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

import grpc

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.session.v1 import session_pb2, session_pb2_grpc
from rlfleet.common import security
from rlfleet.common.chat import CHAT_TEMPLATE
from rlfleet.common.errors import PermissionDenied, require_known_enums
from rlfleet.common.stored_sessions import SESSION_ID, SESSION_ID_RULE
from rlfleet.session.closing import ABORTED_STATUS, VERDICT_MISSING, Closer
from rlfleet.session.errors import (
    FirstTurnPending,
    InvalidSessionRequest,
    SessionBusy,
    SessionExists,
    SessionNotOpen,
    SessionsExhausted,
)
from rlfleet.session.gateway_client import GatewayClient
from rlfleet.session.inputs import Inputs
from rlfleet.session.metrics import SessionMetrics
from rlfleet.session.state import OPEN, SessionState, append_generated, append_observation, append_prompt
from rlfleet.session.store import SessionStore

log = logging.getLogger(__name__)
CLOSE_STATUSES = set(common_pb2.TrajectoryStatus.values())


class SessionServicer(session_pb2_grpc.SessionServiceServicer):
    def __init__(self, run_id: str, store: SessionStore, inputs: Inputs, gateway: GatewayClient,
                 closer: Closer, metrics: SessionMetrics, turn_lease_s: float = 10.0) -> None:
        self.turn_lease_s = turn_lease_s
        self.run_id = run_id
        self.store = store
        self.inputs = inputs
        self.gateway = gateway
        self.closer = closer
        self.metrics = metrics
        self.model_info = model_info(inputs)

    async def OpenSession(self, request: session_pb2.OpenSessionRequest, context: grpc.aio.ServicerContext):
        session_id = _session_id(request.session_id) if request.session_id else uuid.uuid4().hex
        self._check_run(request.run_id)
        # No lookup first: the script that creates the session says when the id exists (a retried
        # open, answered by `_reopened`), one Redis round trip fewer for every new session.
        budget = self.inputs.budget(request.max_total_tokens)
        prompt = await self.inputs.prompt_ids_off_loop(request, budget)
        self.inputs.check_sampling_defaults(request.sampling, budget)
        state = _new_state(session_id, self.run_id, request, budget, self.inputs.metadata(request.metadata))
        state.owner = security.caller().owner
        append_prompt(state, prompt)
        lease = uuid.uuid4().hex if request.first_turn else ""
        # Admitted in the script that creates the session, on what the gateway advertises (no Admit
        # round trip); through the gateway only while no gateway has advertised yet.
        try:
            outcome = await self.store.create(state, lease, self.turn_lease_s, admit=True)
        except SessionsExhausted as exc:
            self.metrics.sessions_refused.add(1, {"reason": exc.reason})
            raise
        if outcome == "no_advert":
            await self._admit(session_id)
            try:
                outcome = await self.store.create(state, lease, self.turn_lease_s)
            except SessionsExhausted:
                # do not hold an admission slot for a session that is not there
                await self.gateway.release(session_id)
                raise
        if outcome != "created":  # a retried open, or one concurrent under the same id
            existing = await self.store.find(session_id)
            if existing is None or not self.store.visible(existing.owner.encode()):
                raise SessionExists(f"session id {session_id!r} is taken; a new episode needs a new "
                                    "session_id (leave it empty for a generated one)", session_id=session_id)
            return await self._reopened(existing, request)
        self.metrics.sessions_opened.add(1)
        opened = _opened(state)
        if lease:  # the first turn, under the lease the create took (nobody else knows the session yet)
            opened.first_turn.CopyFrom(await self._turn(state,
                                                        session_pb2.GenerateRequest(session_id=session_id),
                                                        time.monotonic(), lease))
        return opened

    async def Generate(self, request: session_pb2.GenerateRequest, context):
        started = time.monotonic()
        # The lease is taken and the session read under it in one round trip, so no turn can end
        # between the read and the lease.
        state, lease = await self.store.begin_turn_and_load(_session_id(request.session_id),
                                                            self.turn_lease_s)
        try:
            self._check_open(state)
        except SessionNotOpen:
            if lease is not None:
                await self.store.end_turn(state.session_id, lease)
            raise
        if lease is None:
            raise SessionBusy(f"session {state.session_id!r} is generating a turn already; calls on one "
                              "session must not overlap", session_id=state.session_id)
        return await self._turn(state, request, started, lease)

    async def _turn(self, state: SessionState, request: session_pb2.GenerateRequest, started: float,
                    lease: str) -> session_pb2.GenerateResponse:
        """A turn under `lease`, renewed while it runs and ended by its commit (or here, if it fails)."""
        renewing = asyncio.create_task(self._keep_turn(state.session_id, lease))
        ended = False
        try:
            reply = await self._generate(state, request, started, lease)
            ended = True  # its commit ended the turn
            return reply
        finally:
            renewing.cancel()
            if not ended:
                await self.store.end_turn(state.session_id, lease)

    async def _keep_turn(self, session_id: str, lease: str) -> None:
        """Renews the turn lease while the turn runs; a server that dies stops renewing it."""
        while True:
            await asyncio.sleep(self.turn_lease_s / 3)
            try:
                await self.store.renew_turn(session_id, lease, self.turn_lease_s)
            except Exception:
                # Redis away for a moment: the commit's compare-and-set still guards the session
                log.warning("renewing a turn lease failed", extra={"session_id": session_id})

    async def _generate(self, state: SessionState, request: session_pb2.GenerateRequest, started: float,
                        lease: str):
        """The turn; every way out that returns has committed the state, ending the turn `lease`."""
        observed: list[int] = []
        if request.HasField("observation"):
            ids = observed = await self.inputs.observation_ids_off_loop(request.observation, state)
            append_observation(state, ids, time.time())
            self.metrics.observation_tokens.add(len(ids))
            if state.budget_exhausted:  # no room for a turn: keep the observation, generate nothing
                await self.store.commit(state, end_turn=lease)
                return session_pb2.GenerateResponse(total_tokens=state.total_tokens, budget_exhausted=True,
                                                    observation_token_ids=observed)
        sampling = self.inputs.turn_sampling(state,
                                             request.sampling if request.HasField("sampling") else None)
        request_id = f"{state.session_id}-{len(state.session.spans)}-{uuid.uuid4().hex[:8]}"
        # `engine_pool` in the session's metadata pins it to a pool (evaluations of a canary candidate).
        reply = await self.gateway.generate(state.session_id, state.session.token_ids, sampling, request_id,
                                            state.session.metadata.get("engine_pool", ""))
        span_index = append_generated(state, reply, time.time())
        await self.store.commit(state, end_turn=lease)
        output = list(reply.output_ids)
        tokenizer = self.inputs.tokenizer
        elapsed = time.monotonic() - started
        self.metrics.generate_seconds.record(elapsed)
        self.metrics.overhead_seconds.record(max(0.0, elapsed - reply.latency_s))
        self.metrics.generated_tokens.add(len(reply.output_ids))
        response = session_pb2.GenerateResponse(
            token_ids=output, logprobs=reply.output_logprobs, finish_reason=reply.finish_reason,
            policy_version=reply.policy_version, text=tokenizer.decode(output), engine_id=reply.engine_id,
            span_index=span_index, total_tokens=state.total_tokens, budget_exhausted=state.budget_exhausted,
            observation_token_ids=observed,
            text_with_special_tokens=tokenizer.decode(output, skip_special_tokens=False))
        stops = {*tokenizer.stop_token_ids, *sampling.stop_token_ids}
        if reply.finish_reason == common_pb2.FINISH_REASON_STOP and output and output[-1] in stops:
            response.matched_stop_token_id = output[-1]
        return response

    async def GetModelInfo(self, request: session_pb2.GetModelInfoRequest, context):
        return self.model_info

    async def AppendObservation(self, request: session_pb2.AppendObservationRequest, context):
        state = await self._open_session(request.session_id)
        ids = await self.inputs.observation_ids_off_loop(request, state)
        span_index, waited = append_observation(state, ids, time.time())
        await self.store.commit(state)
        self.metrics.observation_tokens.add(len(ids))
        return session_pb2.AppendObservationResponse(
            token_ids=ids, span_index=span_index, total_tokens=state.total_tokens, tool_wait_s=waited,
            budget_exhausted=state.budget_exhausted)

    async def GetSession(self, request: session_pb2.GetSessionRequest, context):
        return await self.store.load_session(_session_id(request.session_id))

    async def CloseSession(self, request: session_pb2.CloseSessionRequest, context):
        require_known_enums(request)
        if request.status not in CLOSE_STATUSES:
            raise InvalidSessionRequest(f"unknown trajectory status {request.status}", field="status")
        metadata = self.inputs.metadata(request.metadata)
        self._check_caller_run()
        closed = await self.closer.close(_session_id(request.session_id), request.status, metadata)
        response = session_pb2.CloseSessionResponse(
            trajectory_id=closed.trajectory.trajectory_id, verdict=closed.trajectory.verdict,
            published_now=closed.published_now, verdict_missing=VERDICT_MISSING in closed.trajectory.metadata)
        if request.return_trajectory:
            response.trajectory.CopyFrom(closed.trajectory)
        return response

    async def AbortSession(self, request: session_pb2.AbortSessionRequest, context):
        metadata = {"abort_reason": request.reason} if request.reason else {}
        closed = await self.closer.close(_session_id(request.session_id), ABORTED_STATUS,
                                         self.inputs.metadata(metadata, "reason"))
        return session_pb2.AbortSessionResponse(trajectory_id=closed.trajectory.trajectory_id)

    # --- helpers --------------------------------------------------------------------------------
    async def _reopened(self, existing: SessionState,
                        request: session_pb2.OpenSessionRequest) -> session_pb2.OpenSessionResponse:
        """A retried open gets the same answer, its first turn included; an open of the same id with
        another prompt or task is refused."""
        opened = _opened(existing)
        try:
            prompt = self.inputs.prompt_ids(request, existing.session.max_total_tokens)
        except InvalidSessionRequest:
            prompt = None
        if prompt != list(opened.prompt_token_ids) or request.task_id != existing.session.task_id:
            raise SessionExists(
                f"session {existing.session_id!r} exists with another prompt or task_id; "
                "a retried OpenSession must repeat the first one's, a new episode needs a new session_id",
                session_id=existing.session_id)
        if request.first_turn:
            first = self._first_turn_of(existing) or await self._first_turn_again(existing.session_id)
            opened.first_turn.CopyFrom(first)
        return opened

    async def _first_turn_again(self, session_id: str) -> session_pb2.GenerateResponse:
        """The first turn for a retried open that finds none committed: the open it retries created
        the session and stopped inside its first turn. A server killed there leaves its turn lease to
        lapse (within `turn_lease_s`), and the turn is generated here under a lease of this call's own;
        one still renewed belongs to a live call, whose committed turn is the answer. Without this the
        retried open answered with no first turn and the client's Generate met the dead server's lease
        (SessionBusy), failing the episode."""
        deadline = time.monotonic() + 2 * self.turn_lease_s
        delay = 0.05
        while True:
            started = time.monotonic()
            state, lease = await self.store.begin_turn_and_load(session_id, self.turn_lease_s)
            first = self._first_turn_of(state)
            if lease is not None:
                if first is not None:  # the other call committed it just now
                    await self.store.end_turn(session_id, lease)
                    return first
                try:
                    self._check_open(state)
                    if len(state.session.spans) > 1:  # turns without a first one: not this open's session
                        raise SessionExists(f"session {session_id!r} was opened without a first turn; a "
                                            "retried OpenSession must repeat the first one's",
                                            session_id=session_id)
                except (SessionNotOpen, SessionExists):
                    await self.store.end_turn(session_id, lease)
                    raise
                return await self._turn(state, session_pb2.GenerateRequest(session_id=session_id), started,
                                        lease)
            if first is not None:
                return first
            if time.monotonic() + delay > deadline:
                raise FirstTurnPending(f"session {session_id!r}: another call is still generating its first "
                                       "turn; retry the open", session_id=session_id, retry_after_s=1.0)
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)

    def _first_turn_of(self, state: SessionState) -> session_pb2.GenerateResponse | None:
        """The first turn as its Generate answered it, rebuilt from the session (a retried open)."""
        spans = state.session.spans
        if len(spans) < 2 or spans[1].kind != common_pb2.SPAN_KIND_GENERATED:
            return None
        span, session = spans[1], state.session
        output = list(session.token_ids[span.start:span.end])
        tokenizer = self.inputs.tokenizer
        first = session_pb2.GenerateResponse(
            token_ids=output, logprobs=session.rollout_logprobs[span.start:span.end],
            finish_reason=span.finish_reason,
            policy_version=span.policy_version, text=tokenizer.decode(output), engine_id=span.engine_id,
            span_index=1, total_tokens=span.end, budget_exhausted=span.end >= session.max_total_tokens,
            text_with_special_tokens=tokenizer.decode(output, skip_special_tokens=False))
        stops = {*tokenizer.stop_token_ids, *state.sampling.stop_token_ids}  # the first turn has no override
        if span.finish_reason == common_pb2.FINISH_REASON_STOP and output and output[-1] in stops:
            first.matched_stop_token_id = output[-1]
        return first

    async def _open_session(self, session_id: str) -> SessionState:
        state = await self.store.load(_session_id(session_id))
        self._check_open(state)
        return state

    @staticmethod
    def _check_open(state: SessionState) -> None:
        if state.expired:
            raise SessionNotOpen(
                f"session {state.session_id!r} expired: no call for session_idle_timeout_s; "
                f"it was published as aborted (trajectory {state.session.trajectory_id})",
                session_id=state.session_id, state="expired")
        if state.session.state != OPEN:
            raise SessionNotOpen(
                f"session {state.session_id!r} is {state.state_name} (trajectory "
                f"{state.session.trajectory_id})", session_id=state.session_id, state=state.state_name)

    async def _admit(self, session_id: str) -> None:
        try:
            await self.gateway.admit(session_id, self.run_id)
        except SessionsExhausted as exc:
            self.metrics.sessions_refused.add(1, {"reason": exc.reason})
            raise

    def _check_caller_run(self) -> None:
        """A token for another run sees nothing of this one (its sessions are not found)."""
        principal = security.caller()
        if not principal.may_use_run(self.run_id):
            raise PermissionDenied(f"the caller's token is for run {principal.run!r}; "
                                   f"this session server serves run {self.run_id!r}",
                                   right=f"run:{self.run_id}", run_id=self.run_id)

    def _check_run(self, run_id: str) -> None:
        self._check_caller_run()
        if run_id and run_id != self.run_id:
            raise InvalidSessionRequest(f"this session server serves run {self.run_id!r}, not {run_id!r}",
                                        field="run_id")


def model_info(inputs: Inputs) -> session_pb2.ModelInfo:
    tokenizer, renderer = inputs.tokenizer, inputs.renderer
    config_file = tokenizer.path / "tokenizer_config.json"
    model_config = tokenizer.path / "config.json"
    special = renderer.special_tokens
    return session_pb2.ModelInfo(
        tokenizer_json=tokenizer.json,
        tokenizer_config_json=config_file.read_text(encoding="utf-8") if config_file.exists() else "",
        chat_template=renderer.template_source if renderer.uses_model_template else CHAT_TEMPLATE,
        bos_token=special.get("bos_token", ""), eos_token=special.get("eos_token", ""),
        pad_token=special.get("pad_token", ""),
        special_tokens=[session_pb2.SpecialToken(content=c, id=i)
                        for i, c in sorted(tokenizer.special_tokens.items())],
        stop_token_ids=tokenizer.stop_token_ids, vocab_size=tokenizer.vocab_size,
        context_length=inputs.limits.context_length or 0,
        model_type=(json.loads(model_config.read_text()).get("model_type", "") if model_config.exists()
                    else ""))


def _session_id(session_id: str) -> str:
    if not SESSION_ID.match(session_id):
        raise InvalidSessionRequest(
            f"session_id must be {SESSION_ID_RULE}, got {session_id!r}",
            field="session_id")
    return session_id


def _new_state(session_id: str, run_id: str, request: session_pb2.OpenSessionRequest, budget: int,
               metadata: dict[str, str]) -> SessionState:
    session = session_pb2.Session(
        session_id=session_id, state=OPEN, run_id=run_id, task_id=request.task_id, group_id=request.group_id,
        sample_index=request.sample_index, max_total_tokens=budget, metadata=metadata)
    return SessionState(session=session, sampling=request.sampling, group_size=request.group_size,
                        suite=request.suite, split=request.split, opened_ms=int(time.time() * 1000))


def _opened(state: SessionState) -> session_pb2.OpenSessionResponse:
    prompt = state.session.spans[0]
    return session_pb2.OpenSessionResponse(session_id=state.session_id,
                                           prompt_token_ids=state.session.token_ids[prompt.start:prompt.end],
                                           max_total_tokens=state.session.max_total_tokens)
