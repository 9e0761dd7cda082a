"""Limits and bad input on the rollout tier as processes: admission (in-flight and staleness budgets),
open-session and token budgets, and every malformed request refused with a status and a reason."""

from __future__ import annotations

import grpc
import pytest

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from rlfleet.api.session.v1 import session_pb2 as pb
from rlfleet.api.session.v1 import session_pb2_grpc
from rlfleet.common.grpc_server import channel
from rlfleet.common.rich_errors import error_details
from rlfleet.common.testing import unique_run_id
from rlfleet.engine.testing import tiny_model
from rlfleet.session.testing import Rollout, read_trajectories

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BUDGET = 48
MAX_OPEN = 3
Code = grpc.StatusCode


@pytest.fixture(scope="module")
def rollout(nats_url, redis_url, tmp_path_factory):
    model = tiny_model(tmp_path_factory.getbasetemp() / "models")
    stack = Rollout(tmp_path_factory.mktemp("rollout-limits"), nats_url, redis_url, model,
                    unique_run_id("lim"))
    stack.start(engines=1, session={"max_total_tokens": BUDGET, "max_open_sessions": MAX_OPEN})
    yield stack
    stack.stop()


@pytest.fixture
async def stubs(rollout):
    async with channel(rollout.session.address) as ch, channel(rollout.gateway.address) as gch:
        yield session_pb2_grpc.SessionServiceStub(ch), gateway_pb2_grpc.GatewayServiceStub(gch)


@pytest.fixture
async def policy(stubs):
    """Sets the run's admission policy for one test and restores the open default after it."""
    _sessions, gateway = stubs

    async def set_policy(**fields):
        return await gateway.SetAdmissionPolicy(gateway_pb2.AdmissionPolicy(**fields))

    yield set_policy
    await set_policy(max_inflight_sessions=0, max_staleness=-1)


def prompt(*ids: int, **request) -> pb.OpenSessionRequest:
    request.setdefault("sampling", common_pb2.SamplingParams(max_new_tokens=4, seed=1))
    return pb.OpenSessionRequest(prompt_token_ids=common_pb2.TokenIds(ids=list(ids or (1, 40, 41))),
                                 **request)


async def refused(call, request) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await call(request)
    return failure.value


async def test_admission_refuses_a_session_beyond_the_inflight_budget_until_one_closes(stubs, policy):
    sessions, gateway = stubs
    await policy(max_inflight_sessions=2)
    first, _second = [await sessions.OpenSession(prompt()) for _ in range(2)]
    error = await refused(sessions.OpenSession, prompt())
    assert error.code() == Code.RESOURCE_EXHAUSTED and "inflight_limit" in error.details()
    details = error_details(error)  # the same, as fields: why, and when to come back (the gateway's hint)
    assert details.reason == "SESSIONS_EXHAUSTED" and details.metadata["reason"] == "inflight_limit"
    assert details.retry_after_s == pytest.approx(0.5)
    await sessions.CloseSession(pb.CloseSessionRequest(session_id=first.session_id))  # releases its slot
    third = await sessions.OpenSession(prompt())
    status = await gateway.GetAdmissionStatus(gateway_pb2.GetAdmissionStatusRequest())
    assert status.inflight_sessions == 2 and status.refused_by_reason["inflight_limit"] >= 1
    for session_id in (_second.session_id, third.session_id):
        await sessions.AbortSession(pb.AbortSessionRequest(session_id=session_id))


async def test_without_the_gateways_advert_a_session_is_admitted_through_the_gateway(rollout, stubs, policy):
    """The session server admits in its create script by what the gateway advertises; with no advert
    (a gateway that never wrote one, a lost key) it asks the gateway's Admit, by the same rules."""
    import redis.asyncio as aioredis

    from rlfleet.common.session_slots import fleet_key

    sessions, _gateway = stubs
    await policy(max_inflight_sessions=1)
    redis = aioredis.Redis.from_url(rollout.redis_url)
    try:
        # the gateway writes it again next health round
        assert await redis.delete(fleet_key(rollout.run_id)) == 1
        first = await sessions.OpenSession(prompt())
        error = await refused(sessions.OpenSession, prompt())
        assert error.code() == Code.RESOURCE_EXHAUSTED and "inflight_limit" in error.details()
        # gives the slot back
        await sessions.AbortSession(pb.AbortSessionRequest(session_id=first.session_id))
        again = await sessions.OpenSession(prompt())
        await sessions.AbortSession(pb.AbortSessionRequest(session_id=again.session_id))
    finally:
        await redis.aclose()


async def test_admission_refuses_new_sessions_while_the_fleet_is_too_stale(stubs, policy):
    sessions, _gateway = stubs
    status = await policy(trainer_version=5, max_staleness=2)  # the engine serves version 0
    assert status.fleet_min_version == 0
    error = await refused(sessions.OpenSession, prompt())
    assert error.code() == Code.RESOURCE_EXHAUSTED and "stale" in error.details()
    await policy(trainer_version=2, max_staleness=2)
    opened = await sessions.OpenSession(prompt())
    await sessions.AbortSession(pb.AbortSessionRequest(session_id=opened.session_id))


async def test_open_sessions_are_limited_and_a_refused_one_holds_no_admission_slot(stubs):
    sessions, gateway = stubs
    opened = [await sessions.OpenSession(prompt()) for _ in range(MAX_OPEN)]
    error = await refused(sessions.OpenSession, prompt())
    assert error.code() == Code.RESOURCE_EXHAUSTED and "max_open_sessions" in error.details()
    details = error_details(error)
    assert details.metadata["reason"] == "max_open_sessions" and details.retry_after_s == pytest.approx(1.0)
    assert ((await gateway.GetAdmissionStatus(gateway_pb2.GetAdmissionStatusRequest())).inflight_sessions
            == MAX_OPEN)
    for session in opened:
        await sessions.AbortSession(pb.AbortSessionRequest(session_id=session.session_id))
    assert (await gateway.GetAdmissionStatus(gateway_pb2.GetAdmissionStatusRequest())).inflight_sessions == 0


async def test_a_spent_token_budget_caps_the_last_turn_and_closes_as_truncated(rollout, stubs):
    sessions, _gateway = stubs
    opened = await sessions.OpenSession(prompt(1, 40, 41, 42))
    assert opened.max_total_tokens == BUDGET
    sid = opened.session_id
    replies = []
    while not (replies and replies[-1].budget_exhausted):
        replies.append(await sessions.Generate(pb.GenerateRequest(
            session_id=sid, sampling=common_pb2.SamplingParams(max_new_tokens=20, ignore_eos=True))))
    assert [len(r.token_ids) for r in replies] == [20, 20, 4] and replies[-1].total_tokens == BUDGET
    assert replies[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    error = await refused(sessions.Generate, pb.GenerateRequest(session_id=sid))
    assert error.code() == Code.FAILED_PRECONDITION and "spent its budget of 48 tokens" in error.details()
    error = await refused(sessions.AppendObservation, pb.AppendObservationRequest(session_id=sid, text="x"))
    assert (error.code() == Code.INVALID_ARGUMENT
            and "only 0 of the session's 48-token budget remain" in error.details())
    closed = await sessions.CloseSession(pb.CloseSessionRequest(session_id=sid))
    (trajectory,) = [t for t in await read_trajectories(rollout.nats_url, rollout.run_id, wait_s=0.5)
                     if t.trajectory_id == closed.trajectory_id]
    assert trajectory.status == common_pb2.TRAJECTORY_STATUS_TRUNCATED and len(trajectory.token_ids) == BUDGET


async def test_every_kind_of_bad_input_is_refused_with_its_status_and_what_was_wrong(stubs):
    sessions, _gateway = stubs
    live = (await sessions.OpenSession(prompt())).session_id
    closed = (await sessions.OpenSession(prompt())).session_id
    await sessions.CloseSession(pb.CloseSessionRequest(session_id=closed))
    no_default = (await sessions.OpenSession(pb.OpenSessionRequest(
        prompt_token_ids=common_pb2.TokenIds(ids=[1, 40])))).session_id
    vocab_error = "is outside the vocabulary"
    text = pb.AppendObservationRequest
    cases = [
        (sessions.OpenSession, prompt(1, 99_999), Code.INVALID_ARGUMENT,
         f"prompt_token_ids[1] = 99999 {vocab_error}"),
        (sessions.OpenSession, prompt(-1), Code.INVALID_ARGUMENT, f"prompt_token_ids[0] = -1 {vocab_error}"),
        (sessions.OpenSession, pb.OpenSessionRequest(prompt_token_ids=common_pb2.TokenIds()),
         Code.INVALID_ARGUMENT, "the prompt is empty"),
        (sessions.OpenSession, pb.OpenSessionRequest(), Code.INVALID_ARGUMENT, "a prompt is required"),
        (sessions.OpenSession, prompt(*[5] * BUDGET), Code.INVALID_ARGUMENT, "leaves no room"),
        (sessions.OpenSession, prompt(max_total_tokens=5000), Code.INVALID_ARGUMENT,
         "exceeds the model's context length (1024 tokens)"),
        (sessions.OpenSession, prompt(session_id="no spaces please"), Code.INVALID_ARGUMENT,
         "session_id must be"),
        (sessions.OpenSession, prompt(run_id="another-run"), Code.INVALID_ARGUMENT,
         "this session server serves run"),
        (sessions.OpenSession, pb.OpenSessionRequest(
            messages=common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="robot", content="hi")])),
         Code.INVALID_ARGUMENT, "unknown chat role 'robot'"),
        (sessions.OpenSession, pb.OpenSessionRequest(messages=common_pb2.ChatMessages(
            messages=[common_pb2.ChatMessage(role="user", content="x" * (1 << 20 | 1))])),
         Code.INVALID_ARGUMENT, "more than max_text_chars"),
        (sessions.OpenSession, prompt(metadata={"blob": "x" * (64 << 10)}), Code.INVALID_ARGUMENT,
         "more than max_metadata_bytes"),
        (sessions.OpenSession, prompt(sampling=common_pb2.SamplingParams(max_new_tokens=-2)),
         Code.INVALID_ARGUMENT, "sampling.max_new_tokens must be in [1, 48]"),
        (sessions.Generate, pb.GenerateRequest(session_id="never-opened"), Code.NOT_FOUND, "not found"),
        (sessions.Generate, pb.GenerateRequest(session_id=""), Code.INVALID_ARGUMENT, "session_id must be"),
        (sessions.Generate, pb.GenerateRequest(session_id=closed), Code.FAILED_PRECONDITION, "is closed"),
        (sessions.Generate, pb.GenerateRequest(session_id=no_default), Code.INVALID_ARGUMENT,
         "sampling.max_new_tokens must be > 0"),
        (sessions.Generate, pb.GenerateRequest(session_id=live, sampling=common_pb2.SamplingParams(
            max_new_tokens=-1)), Code.INVALID_ARGUMENT, "must be > 0"),
        (sessions.Generate, pb.GenerateRequest(session_id=live, sampling=common_pb2.SamplingParams(
            max_new_tokens=49)), Code.INVALID_ARGUMENT, "exceeds the session's whole budget of 48"),
        # the engine's words
        (sessions.Generate, pb.GenerateRequest(session_id=live, sampling=common_pb2.SamplingParams(
            max_new_tokens=2, top_p=2.0)), Code.INVALID_ARGUMENT, "top_p must be in (0, 1]"),
        (sessions.AppendObservation, text(session_id="never-opened", text="x"), Code.NOT_FOUND, "not found"),
        (sessions.AppendObservation, text(session_id=closed, text="x"), Code.FAILED_PRECONDITION,
         "is closed"),
        (sessions.AppendObservation, text(session_id=live, token_ids=common_pb2.TokenIds(ids=[3, 70_000])),
         Code.INVALID_ARGUMENT, f"token_ids[1] = 70000 {vocab_error}"),
        (sessions.AppendObservation, text(session_id=live, text=""), Code.INVALID_ARGUMENT,
         "the observation is empty"),
        (sessions.AppendObservation, text(session_id=live), Code.INVALID_ARGUMENT,
         "needs text, token_ids or messages"),
        (sessions.AppendObservation, text(session_id=live, token_ids=common_pb2.TokenIds(ids=[5] * BUDGET)),
         Code.INVALID_ARGUMENT, "more than the 45 that fit"),
        (sessions.GetSession, pb.GetSessionRequest(session_id="never-opened"), Code.NOT_FOUND, "not found"),
        (sessions.CloseSession, pb.CloseSessionRequest(session_id="never-opened"), Code.NOT_FOUND,
         "not found"),
        (sessions.CloseSession, pb.CloseSessionRequest(session_id=live, status=99), Code.INVALID_ARGUMENT,
         "status: 99 is not a known value"),
        (sessions.AbortSession, pb.AbortSessionRequest(session_id=closed), Code.FAILED_PRECONDITION,
         "already closed"),
    ]
    for call, request, code, message in cases:
        error = await refused(call, request)
        assert (error.code(), message in error.details()) == (code, True), (request, error.details())
    # None of that changed the live session.
    state = await sessions.GetSession(pb.GetSessionRequest(session_id=live))
    assert list(state.token_ids) == [1, 40, 41] and state.state == pb.SESSION_STATE_OPEN
    for session_id in (live, no_default):
        await sessions.AbortSession(pb.AbortSessionRequest(session_id=session_id))
