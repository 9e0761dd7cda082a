"""The rollout tier end to end as processes (CPU engine, gateway, session server, NATS, Redis):
multi-turn sessions keep the exact tokens, log-probs and loss mask, and close into one trajectory."""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import grpc
import pytest
from tokenizers import Tokenizer

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.session.v1 import session_pb2 as pb
from rlfleet.api.session.v1 import session_pb2_grpc
from rlfleet.common.config import RedisConfig
from rlfleet.common.grpc_server import channel
from rlfleet.common.redis_store import connect_redis, key
from rlfleet.common.rich_errors import error_details
from rlfleet.common.testing import unique_run_id
from rlfleet.common.verdicts import store_verdict
from rlfleet.engine.testing import tiny_model
from rlfleet.session.testing import Rollout, read_trajectories

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GENERATED = common_pb2.SPAN_KIND_GENERATED


@pytest.fixture(scope="module")
def rollout(nats_url, redis_url, tmp_path_factory):
    model = tiny_model(tmp_path_factory.getbasetemp() / "models")
    stack = Rollout(tmp_path_factory.mktemp("rollout-sessions"), nats_url, redis_url, model,
                    unique_run_id("sessions")).start(engines=1)
    yield stack
    stack.stop()


@pytest.fixture
async def sessions(rollout):
    async with channel(rollout.session.address) as ch:
        yield session_pb2_grpc.SessionServiceStub(ch)


@pytest.fixture(scope="module")
def tokenizer(rollout) -> Tokenizer:
    return Tokenizer.from_file(str(rollout.model / "tokenizer.json"))


def chat(*messages: tuple[str, str]) -> common_pb2.ChatMessages:
    return common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in messages])


def sampling(max_new_tokens: int = 12, **extra) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_new_tokens=max_new_tokens, **extra)


async def open_chat(sessions, question: str = "What is 12*(3+4)?", **request) -> pb.OpenSessionResponse:
    return await sessions.OpenSession(pb.OpenSessionRequest(
        messages=chat(("system", "You are a calculator agent."), ("user", question)),
        sampling=request.pop("sampling", sampling(seed=5)), **request))


@contextlib.asynccontextmanager
async def redis_client(url: str):
    redis = await connect_redis(RedisConfig(url=url))
    try:
        yield redis
    finally:
        await redis.aclose()


async def published(rollout, trajectory_id: str) -> list[common_pb2.Trajectory]:
    return [t for t in await read_trajectories(rollout.nats_url, rollout.run_id, wait_s=0.5)
            if t.trajectory_id == trajectory_id]


async def test_a_multi_turn_episode_is_published_with_exactly_the_tokens_it_was_built_from(
        rollout, sessions, tokenizer):
    opened = await open_chat(sessions, task_id="calc-1", group_id="g1", sample_index=1, group_size=4,
                             metadata={"suite": "calc"}, suite="calc", split="train")
    sid = opened.session_id
    expected = list(opened.prompt_token_ids)
    assert expected == tokenizer.encode(
        "<|im_start|>system\nYou are a calculator agent.<|im_end|>\n<|im_start|>user\n"
        "What is 12*(3+4)?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).ids
    generated: list[tuple[list[int], list[float]]] = []
    observations = [
        pb.AppendObservationRequest(session_id=sid, text="<|im_end|>\n<|im_start|>tool\n84<|im_end|>\n"),
        pb.AppendObservationRequest(session_id=sid, token_ids=common_pb2.TokenIds(ids=[1, 40, 41, 42])),
        pb.AppendObservationRequest(session_id=sid, messages=chat(("user", "And 2+2?")),
                                    add_generation_prompt=True),
    ]
    for turn, observation in enumerate(observations):
        reply = await sessions.Generate(pb.GenerateRequest(session_id=sid))
        assert len(reply.token_ids) == len(reply.logprobs) > 0 and reply.span_index == 2 * turn + 1
        assert reply.text == tokenizer.decode(list(reply.token_ids))
        assert (reply.policy_version, reply.engine_id) == (0, "e0")
        generated.append((list(reply.token_ids), list(reply.logprobs)))
        expected += reply.token_ids
        appended = await sessions.AppendObservation(observation)
        assert appended.total_tokens == len(expected) + len(appended.token_ids)
        expected += appended.token_ids
        assert appended.tool_wait_s > 0
    last = await sessions.Generate(pb.GenerateRequest(session_id=sid, sampling=sampling(5, ignore_eos=True)))
    assert len(last.token_ids) == 5 and last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    generated.append((list(last.token_ids), list(last.logprobs)))
    expected += last.token_ids

    async with redis_client(rollout.redis_url) as redis:  # the verifier's verdict, stored before close
        await store_verdict(redis, rollout.run_id, common_pb2.Verdict(session_id=sid, reward=1.0, passed=True,
                                                                      verify_s=0.25))
    closed = await sessions.CloseSession(pb.CloseSessionRequest(session_id=sid, metadata={"worker": "w1"}))
    assert closed.published_now and closed.verdict.passed
    (trajectory,) = await published(rollout, closed.trajectory_id)

    assert list(trajectory.token_ids) == expected
    spans = list(trajectory.spans)
    assert spans[0].start == 0 and spans[-1].end == len(expected)
    assert all(a.end == b.start for a, b in itertools.pairwise(spans))
    assert [s.kind for s in spans] == ([common_pb2.SPAN_KIND_PROMPT]
                                       + [GENERATED, common_pb2.SPAN_KIND_OBSERVATION] * 3 + [GENERATED])
    generated_spans = [s for s in spans if s.kind == GENERATED]
    for span, (ids, logprobs) in zip(generated_spans, generated, strict=True):
        assert list(trajectory.token_ids[span.start:span.end]) == ids
        assert list(trajectory.rollout_logprobs[span.start:span.end]) == logprobs
        assert (span.policy_version, span.engine_id) == (0, "e0") and span.latency_s > 0
    mask = list(trajectory.loss_mask)
    assert mask == [1 if any(s.start <= i < s.end for s in generated_spans) else 0
                    for i in range(len(expected))]
    assert all(lp == 0 for lp, m in zip(trajectory.rollout_logprobs, mask, strict=True) if not m)
    assert (trajectory.status, trajectory.num_turns, trajectory.num_observations) == (
        common_pb2.TRAJECTORY_STATUS_COMPLETED, 4, 3)
    assert (trajectory.task_id, trajectory.group_id, trajectory.sample_index, trajectory.group_size) == (
        "calc-1", "g1", 1, 4)
    assert dict(trajectory.metadata) == {"suite": "calc", "worker": "w1"}
    assert trajectory.verdict.reward == 1.0 and trajectory.timings.verify_s == 0.25
    assert trajectory.timings.tool_wait_s > 0 and trajectory.timings.generate_s > 0
    assert trajectory.schema_version == common_pb2.SCHEMA_VERSION_1 and trajectory.run_id == rollout.run_id
    session = await sessions.GetSession(pb.GetSessionRequest(session_id=sid))
    assert session.state == pb.SESSION_STATE_CLOSED and session.trajectory_id == closed.trajectory_id


async def test_an_observation_sent_with_generate_is_appended_first_and_kept_only_with_the_turn(
        rollout, sessions, tokenizer):
    opened = await open_chat(sessions, max_total_tokens=96)
    sid = opened.session_id
    first = await sessions.Generate(pb.GenerateRequest(session_id=sid))
    tool = "<|im_end|>\n<|im_start|>tool\n84<|im_end|>\n<|im_start|>assistant\n"
    second = await sessions.Generate(pb.GenerateRequest(
        session_id=sid, observation=pb.AppendObservationRequest(text=tool)))
    observed = tokenizer.encode(tool, add_special_tokens=False).ids
    assert second.span_index == 3 and len(second.token_ids) > 0
    after_second = len(opened.prompt_token_ids) + len(first.token_ids) + len(observed) + len(second.token_ids)
    assert second.total_tokens == after_second

    # An observation that does not fit is refused with the same message as AppendObservation's, and
    # nothing of the call is kept.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await sessions.Generate(pb.GenerateRequest(
            session_id=sid, observation=pb.AppendObservationRequest(text="7" * 200)))  # a token per digit
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "only" in refused.value.details() and "budget remain" in refused.value.details()
    # ... and says so in fields a client reads without parsing the message (gRPC's rich status).
    details = error_details(refused.value)
    assert (details.reason, details.domain) == ("OBSERVATION_OVER_BUDGET", "rlfleet.session")
    assert details.field == "text" and details.metadata["session_id"] == sid
    # One that fills the budget exactly is kept, and nothing is generated.
    room = 96 - after_second
    filled = await sessions.Generate(pb.GenerateRequest(
        session_id=sid,
        observation=pb.AppendObservationRequest(token_ids=common_pb2.TokenIds(ids=[40] * room))))
    assert (list(filled.token_ids), filled.budget_exhausted, filled.total_tokens) == ([], True, 96)
    closed = await sessions.CloseSession(pb.CloseSessionRequest(session_id=sid, return_trajectory=True))
    trajectory = closed.trajectory
    assert list(trajectory.token_ids) == [*opened.prompt_token_ids, *first.token_ids, *observed,
                                          *second.token_ids, *[40] * room]
    assert [s.kind for s in trajectory.spans] == [common_pb2.SPAN_KIND_PROMPT, GENERATED,
                                                  common_pb2.SPAN_KIND_OBSERVATION, GENERATED,
                                                  common_pb2.SPAN_KIND_OBSERVATION]
    assert trajectory.status == common_pb2.TRAJECTORY_STATUS_TRUNCATED and trajectory.num_observations == 2


def boundary_pair(tokenizer: Tokenizer) -> tuple[str, str]:
    """Two texts that BPE merges across their boundary when tokenized together."""
    for whole in (" calc", " answer", " result", " what", " is"):
        for cut in range(2, len(whole) - 1):
            a, b = whole[:cut], whole[cut:]
            if tokenizer.encode(a).ids + tokenizer.encode(b).ids != tokenizer.encode(whole).ids:
                return a, b
    raise AssertionError("no merging pair found")


async def test_the_trajectory_keeps_the_true_ids_where_retokenizing_its_text_would_not(
        rollout, sessions, tokenizer):
    a, b = boundary_pair(tokenizer)
    opened = await open_chat(sessions)
    sid = opened.session_id
    first = await sessions.Generate(pb.GenerateRequest(session_id=sid))
    # Observations whose text merges with its neighbours: the tool output split across two appends,
    # and an observation that starts inside what would be one word with the next generated tokens.
    obs_a = await sessions.AppendObservation(pb.AppendObservationRequest(session_id=sid, text=a))
    obs_b = await sessions.AppendObservation(pb.AppendObservationRequest(session_id=sid, text=b))
    second = await sessions.Generate(pb.GenerateRequest(session_id=sid))
    closed = await sessions.CloseSession(pb.CloseSessionRequest(session_id=sid, return_trajectory=True))
    ids = list(closed.trajectory.token_ids)

    assert ids == [*opened.prompt_token_ids, *first.token_ids, *obs_a.token_ids, *obs_b.token_ids,
                   *second.token_ids]
    text = tokenizer.decode(ids, skip_special_tokens=False)
    retokenized = tokenizer.encode(text, add_special_tokens=False).ids
    assert retokenized != ids  # what a text-based pipeline would have trained on
    boundary = len(opened.prompt_token_ids) + len(first.token_ids)
    assert tokenizer.encode(a + b).ids != [*obs_a.token_ids, *obs_b.token_ids]
    assert (ids[boundary:boundary + len(obs_a.token_ids) + len(obs_b.token_ids)]
            == [*obs_a.token_ids, *obs_b.token_ids])


async def test_rollout_logprobs_match_a_plain_transformers_forward_pass(rollout, sessions):
    import torch
    from transformers import AutoModelForCausalLM

    opened = await open_chat(sessions, sampling=sampling(24, seed=11, temperature=1.0, ignore_eos=True))
    sid = opened.session_id
    await sessions.Generate(pb.GenerateRequest(session_id=sid))
    await sessions.AppendObservation(pb.AppendObservationRequest(session_id=sid,
                                                                 text="<|im_start|>tool\n7<|im_end|>"))
    await sessions.Generate(pb.GenerateRequest(session_id=sid))
    trajectory = (await sessions.CloseSession(pb.CloseSessionRequest(session_id=sid,
                                                                     return_trajectory=True))).trajectory

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(rollout.model), dtype=torch.float32).eval()
    ids = torch.tensor([list(trajectory.token_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    recomputed = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[0, 1:, None])[:, 0]
    mask = torch.tensor(list(trajectory.loss_mask))[1:].bool()
    rollout_lp = torch.tensor(list(trajectory.rollout_logprobs))[1:]
    assert int(mask.sum()) == 48 and trajectory.loss_mask[0] == 0
    assert float((recomputed[mask] - rollout_lp[mask]).abs().max()) <= 1e-4


async def test_closing_again_publishes_nothing_new_and_answers_the_same_trajectory(rollout, sessions):
    opened = await open_chat(sessions)
    await sessions.Generate(pb.GenerateRequest(session_id=opened.session_id))
    close = pb.CloseSessionRequest(session_id=opened.session_id)
    # retried at once
    first, *retries = await asyncio.gather(*(sessions.CloseSession(close) for _ in range(4)))
    later = await sessions.CloseSession(close)
    replies = [first, *retries, later]
    assert len({r.trajectory_id for r in replies}) == 1
    assert sum(r.published_now for r in replies) == 1
    # A close that stored its trajectory but crashed before recording the publish: the retry
    # re-publishes the same bytes under the same Nats-Msg-Id, and JetStream drops the copy.
    async with redis_client(rollout.redis_url) as redis:
        await redis.hset(key(rollout.run_id, "session", opened.session_id), "published", "0")
    again = await sessions.CloseSession(close)
    assert again.trajectory_id == first.trajectory_id and not again.published_now
    assert len(await published(rollout, first.trajectory_id)) == 1


async def test_an_aborted_session_is_published_once_as_aborted_and_cannot_be_closed(rollout, sessions):
    opened = await open_chat(sessions)
    await sessions.Generate(pb.GenerateRequest(session_id=opened.session_id))
    aborted = await sessions.AbortSession(pb.AbortSessionRequest(session_id=opened.session_id,
                                                                 reason="sandbox died"))
    again = await sessions.AbortSession(pb.AbortSessionRequest(session_id=opened.session_id, reason="retry"))
    assert again.trajectory_id == aborted.trajectory_id
    with pytest.raises(grpc.aio.AioRpcError) as close:
        await sessions.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id))
    assert (close.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            and "already aborted" in close.value.details())
    (trajectory,) = await published(rollout, aborted.trajectory_id)
    assert trajectory.status == common_pb2.TRAJECTORY_STATUS_ABORTED
    assert trajectory.metadata["abort_reason"] == "sandbox died"

    done = await open_chat(sessions)
    await sessions.CloseSession(pb.CloseSessionRequest(session_id=done.session_id))
    with pytest.raises(grpc.aio.AioRpcError) as abort:
        await sessions.AbortSession(pb.AbortSessionRequest(session_id=done.session_id))
    assert (abort.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            and "already closed" in abort.value.details())


async def test_opening_with_the_same_session_id_again_returns_the_same_session(rollout, sessions):
    request = pb.OpenSessionRequest(session_id=unique_run_id("retry-open"),
                                    prompt_token_ids=common_pb2.TokenIds(ids=[1, 40, 41]),
                                    sampling=sampling())
    first = await sessions.OpenSession(request)
    retry = await sessions.OpenSession(request)
    assert first == retry and list(first.prompt_token_ids) == [1, 40, 41]
    await sessions.AbortSession(pb.AbortSessionRequest(session_id=first.session_id))


async def test_the_first_turn_comes_with_the_open_as_a_generate_would_make_it_and_a_retry_answers_it(
        rollout, sessions):
    plain = await open_chat(sessions)
    turn = await sessions.Generate(pb.GenerateRequest(session_id=plain.session_id))
    session_id = unique_run_id("first-turn")
    opened = await open_chat(sessions, session_id=session_id, first_turn=True)
    assert opened.HasField("first_turn") and not plain.HasField("first_turn")
    first = opened.first_turn
    # the same seed and prompt: the same tokens and everything else a Generate answers; the log-probs
    # to float rounding only (the engine's prefix cache: two plain Generates of one prompt, one
    # prefilled cold and one from the cache, differ the same way)
    assert list(first.logprobs) == pytest.approx(list(turn.logprobs), abs=1e-5)
    same = [pb.GenerateResponse(), pb.GenerateResponse()]
    for copy, reply in zip(same, (first, turn), strict=True):
        copy.CopyFrom(reply)
        del copy.logprobs[:]
    assert same[0] == same[1] and first.token_ids and first.span_index == 1
    stored = await sessions.GetSession(pb.GetSessionRequest(session_id=session_id))
    assert stored.spans[1].kind == common_pb2.SPAN_KIND_GENERATED
    assert stored.token_ids[stored.spans[1].start:] == first.token_ids
    # a retried open: no second turn
    again = await open_chat(sessions, session_id=session_id, first_turn=True)
    assert again == opened
    assert len((await sessions.GetSession(pb.GetSessionRequest(session_id=session_id))).spans) == 2
    # the episode goes on as any other: the turn lease the open took was given back
    observation = pb.AppendObservationRequest(text="\n<|im_start|>tool\n84<|im_end|>\n"
                                                   "<|im_start|>assistant\n")
    second = await sessions.Generate(pb.GenerateRequest(session_id=session_id, observation=observation))
    assert second.span_index == 3
    for sid in (plain.session_id, session_id):
        await sessions.AbortSession(pb.AbortSessionRequest(session_id=sid))


async def engine_generated_tokens(rollout) -> int:
    from rlfleet.engine.testing import http_call

    status, info = await http_call(rollout.engines["e0"].url, "/server_info", method="GET")
    assert status == 200, info
    return info["generated_tokens"]


async def test_two_overlapping_calls_on_one_session_cannot_both_change_it(rollout, sessions):
    opened = await open_chat(sessions)
    request = pb.GenerateRequest(session_id=opened.session_id, sampling=sampling(32, ignore_eos=True))
    before = await engine_generated_tokens(rollout)

    async def generate():
        return await sessions.Generate(request)

    results = await asyncio.gather(generate(), generate(), return_exceptions=True)
    won = [r for r in results if isinstance(r, pb.GenerateResponse)]
    lost = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(won) == len(lost) == 1
    assert (lost[0].code() == grpc.StatusCode.FAILED_PRECONDITION
            and "generating a turn already" in lost[0].details())
    assert error_details(lost[0]).reason == "SESSION_BUSY"
    # The refused call cost no engine work: the engine generated the winner's tokens only.
    assert await engine_generated_tokens(rollout) - before == len(won[0].token_ids) == 32
    session = await sessions.GetSession(pb.GetSessionRequest(session_id=opened.session_id))
    assert [s.kind for s in session.spans] == [common_pb2.SPAN_KIND_PROMPT, GENERATED]
    assert list(session.token_ids) == [*opened.prompt_token_ids, *won[0].token_ids]
    await sessions.AbortSession(pb.AbortSessionRequest(session_id=opened.session_id))


async def test_reopening_a_session_id_with_another_prompt_is_already_exists(rollout, sessions):
    opened = await open_chat(sessions, session_id="reopen-1", task_id="t1")
    again = await open_chat(sessions, session_id="reopen-1", task_id="t1")  # a retry: the same answer
    assert list(again.prompt_token_ids) == list(opened.prompt_token_ids)
    for other in ({"question": "What is 1+1?", "task_id": "t1"}, {"task_id": "t2"}):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await open_chat(sessions, session_id="reopen-1", **other)
        assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert error_details(refused.value).reason == "SESSION_EXISTS"
    await sessions.AbortSession(pb.AbortSessionRequest(session_id="reopen-1"))


async def test_a_second_close_with_another_status_is_refused_and_one_without_a_verdict_is_marked(
        rollout, sessions):
    opened = await open_chat(sessions)
    sid = opened.session_id
    await sessions.Generate(pb.GenerateRequest(session_id=sid))
    closed = await sessions.CloseSession(pb.CloseSessionRequest(
        session_id=sid, status=common_pb2.TRAJECTORY_STATUS_FAILED))
    assert closed.verdict_missing
    (trajectory,) = await published(rollout, closed.trajectory_id)
    assert trajectory.metadata["rlfleet.verdict_missing"] == "1"
    same = await sessions.CloseSession(pb.CloseSessionRequest(session_id=sid,
                                                              status=common_pb2.TRAJECTORY_STATUS_FAILED))
    assert same.trajectory_id == closed.trajectory_id and not same.published_now
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await sessions.CloseSession(pb.CloseSessionRequest(session_id=sid,
                                                           status=common_pb2.TRAJECTORY_STATUS_COMPLETED))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "already closed as TRAJECTORY_STATUS_FAILED" in refused.value.details()


async def test_a_request_with_invalid_utf8_is_invalid_argument(rollout):
    async with channel(rollout.session.address) as ch:
        call = ch.unary_unary("/rlfleet.session.v1.SessionService/OpenSession",
                              request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call(b"\x0a\x02\xff\xfe")  # field 1 (session_id): two bytes that are no UTF-8
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "bad UTF-8" in refused.value.details()


async def test_model_info_gives_what_a_client_needs_to_tokenize_and_frame(rollout, sessions, tokenizer):
    info = await sessions.GetModelInfo(pb.GetModelInfoRequest())
    assert Tokenizer.from_str(info.tokenizer_json).encode("<|im_start|>user\nhi").ids == tokenizer.encode(
        "<|im_start|>user\nhi").ids
    assert [(t.content, t.id) for t in info.special_tokens] == [("<|endoftext|>", 0), ("<|im_start|>", 1),
                                                                ("<|im_end|>", 2)]
    assert list(info.stop_token_ids) == [0, 2] and info.eos_token == "<|endoftext|>"
    assert "<|im_start|>" in info.chat_template and info.model_type == "qwen2"
    assert info.vocab_size == tokenizer.get_vocab_size() and info.context_length == 1024


async def test_generate_returns_the_observation_ids_and_the_stop_token_it_ended_on(
        rollout, sessions, tokenizer):
    opened = await open_chat(sessions, sampling=sampling(24, seed=3))
    sid = opened.session_id
    first = await sessions.Generate(pb.GenerateRequest(session_id=sid, sampling=sampling(
        24, stop_token_ids=list(range(3, 400)))))  # nearly every token stops: the turn ends on its first
    assert first.finish_reason == common_pb2.FINISH_REASON_STOP
    assert first.HasField("matched_stop_token_id") and first.matched_stop_token_id == first.token_ids[-1]
    assert first.text_with_special_tokens == tokenizer.decode(list(first.token_ids),
                                                              skip_special_tokens=False)
    second = await sessions.Generate(pb.GenerateRequest(
        session_id=sid, sampling=sampling(3, ignore_eos=True),
        observation=pb.AppendObservationRequest(messages=chat(("tool", "84")), add_generation_prompt=True)))
    assert (second.finish_reason == common_pb2.FINISH_REASON_LENGTH
            and not second.HasField("matched_stop_token_id"))
    session = await sessions.GetSession(pb.GetSessionRequest(session_id=sid))
    observation = session.spans[2]
    assert list(session.token_ids[observation.start:observation.end]) == list(second.observation_token_ids)
    # The turn did not end on <|im_end|>, so the observation closes it as the template would.
    assert tokenizer.decode(list(second.observation_token_ids), skip_special_tokens=False) == (
        "<|im_end|>\n<|im_start|>tool\n84<|im_end|>\n<|im_start|>assistant\n")
    await sessions.AbortSession(pb.AbortSessionRequest(session_id=sid))


async def test_an_idle_session_is_expired_published_released_and_answered_as_expired(rollout, tmp_path):
    from rlfleet.common.processes import ServiceProcess, free_port
    from rlfleet.session.testing import session_server_config

    config = session_server_config(rollout.nats_url, rollout.redis_url, rollout.run_id,
                                   rollout.gateway.address, str(rollout.model),
                                   **{"grpc.port": free_port(), "session_idle_timeout_s": 1.0,
                                      "expiry_sweep_s": 0.2})
    server = ServiceProcess("rlfleet-session-server", tmp_path, config=config).spawn().wait_ready()
    try:
        async with channel(server.address) as ch:
            expiring = session_pb2_grpc.SessionServiceStub(ch)
            opened = await open_chat(expiring)
            sid = opened.session_id
            await expiring.Generate(pb.GenerateRequest(session_id=sid))
            for _ in range(100):
                await asyncio.sleep(0.1)
                session = await expiring.GetSession(pb.GetSessionRequest(session_id=sid))
                if session.state != pb.SESSION_STATE_OPEN:
                    break
            assert session.state == pb.SESSION_STATE_ABORTED and session.trajectory_id
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await expiring.Generate(pb.GenerateRequest(session_id=sid))
            assert (refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                    and "expired" in refused.value.details())
            assert error_details(refused.value).metadata["state"] == "expired"
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await expiring.CloseSession(pb.CloseSessionRequest(session_id=sid))
            assert "expired" in refused.value.details()
        (trajectory,) = await published(rollout, session.trajectory_id)
        assert trajectory.status == common_pb2.TRAJECTORY_STATUS_ABORTED
        assert trajectory.metadata["abort_reason"] == "expired"
        async with redis_client(rollout.redis_url) as redis:  # the admission slot was given back
            stored = await redis.hgetall(key(rollout.run_id, "session", sid))
            assert stored[b"released"] == b"1" and stored[b"published"] == b"1"
            assert await redis.zscore(key(rollout.run_id, "sessions", "open"), sid) is None
            # given back by the commit that sealed it: no admission slot, no engine affinity left
            assert await redis.zscore(key(rollout.run_id, "admission", "inflight"), sid) is None
            assert await redis.get(key(rollout.run_id, "affinity", sid)) is None
    finally:
        server.stop()
