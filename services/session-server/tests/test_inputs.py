"""Request content to tokens, budgets and sampling: bad input is refused with a message that says why."""

import asyncio

import pytest

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.session.v1 import session_pb2
from rlfleet.session.errors import InvalidSessionRequest, SessionNotOpen
from rlfleet.session.inputs import Inputs, Limits
from rlfleet.session.state import SessionState, append_prompt
from rlfleet.session.text import Tokenizer, load_chat_renderer


@pytest.fixture
def inputs(tokenizer_dir) -> Inputs:
    limits = Limits(context_length=64, default_budget=4096, max_text_chars=100, max_metadata_bytes=20)
    return Inputs(Tokenizer(str(tokenizer_dir)), load_chat_renderer(str(tokenizer_dir), "auto"), limits)


def state_with(prompt: list[int], budget: int, **sampling) -> SessionState:
    state = SessionState(session=session_pb2.Session(session_id="s", max_total_tokens=budget),
                         sampling=common_pb2.SamplingParams(**sampling))
    append_prompt(state, prompt)
    return state


def test_the_budget_is_the_requested_one_or_the_default_capped_to_the_context(inputs):
    assert inputs.budget(0) == 64 and inputs.budget(32) == 32
    with pytest.raises(InvalidSessionRequest, match="max_total_tokens 65 exceeds the model's context length"):
        inputs.budget(65)


def test_prompts_are_checked_for_presence_vocabulary_and_room(inputs):
    vocab = inputs.tokenizer.vocab_size
    cases = [
        (session_pb2.OpenSessionRequest(), "a prompt is required"),
        (session_pb2.OpenSessionRequest(prompt_token_ids=common_pb2.TokenIds()), "the prompt is empty"),
        (session_pb2.OpenSessionRequest(prompt_token_ids=common_pb2.TokenIds(ids=[1, vocab])),
         f"prompt_token_ids\\[1\\] = {vocab} is outside the vocabulary \\[0, {vocab}\\)"),
        (session_pb2.OpenSessionRequest(prompt_token_ids=common_pb2.TokenIds(ids=[5] * 10)),
         "leaves no room in the session's budget of 10 tokens"),
        (session_pb2.OpenSessionRequest(messages=common_pb2.ChatMessages()), "messages is empty"),
        (session_pb2.OpenSessionRequest(messages=common_pb2.ChatMessages(
            messages=[common_pb2.ChatMessage(role="user", content="x" * 101)])), "more than max_text_chars"),
    ]
    for request, message in cases:
        with pytest.raises(InvalidSessionRequest, match=message):
            inputs.prompt_ids(request, 10)


def test_a_chat_prompt_is_rendered_with_the_generation_prompt_and_tokenized_once(inputs):
    request = session_pb2.OpenSessionRequest(messages=common_pb2.ChatMessages(
        messages=[common_pb2.ChatMessage(role="user", content="What is 2+3?")]))
    ids = inputs.prompt_ids(request, 64)
    assert inputs.tokenizer.decode(ids) == "user\nWhat is 2+3?\nassistant\n"
    assert ids[0] == 1 and ids.count(1) == 2  # two <|im_start|>


def test_turn_sampling_merges_overrides_and_caps_max_new_tokens_to_the_remaining_budget(inputs):
    state = state_with([1, 2, 3], budget=10, max_new_tokens=5, temperature=0.5, seed=7, stop=["a"])
    turn = inputs.turn_sampling(state, None)
    assert (turn.max_new_tokens, turn.temperature, turn.seed, list(turn.stop)) == (5, 0.5, 7, ["a"])
    state.num_turns = 2  # a session-wide seed moves on each turn
    assert inputs.turn_sampling(state, None).seed == 9
    override = common_pb2.SamplingParams(max_new_tokens=9, temperature=1.0, stop=["b"])
    turn = inputs.turn_sampling(state, override)
    assert (turn.max_new_tokens, turn.temperature, list(turn.stop)) == (7, 1.0, ["b"])


def test_turn_sampling_refuses_what_cannot_run(inputs):
    with pytest.raises(InvalidSessionRequest, match="max_new_tokens must be > 0"):
        inputs.turn_sampling(state_with([1], budget=10), None)
    with pytest.raises(InvalidSessionRequest, match="max_new_tokens must be > 0"):
        inputs.turn_sampling(state_with([1], budget=10), common_pb2.SamplingParams(max_new_tokens=-3))
    with pytest.raises(InvalidSessionRequest, match="exceeds the session's whole budget of 10"):
        inputs.turn_sampling(state_with([1], budget=10, max_new_tokens=11), None)
    with pytest.raises(SessionNotOpen, match="has spent its budget"):
        inputs.turn_sampling(state_with([1] * 10, budget=10, max_new_tokens=2), None)


def test_observations_must_be_present_in_the_vocabulary_and_fit_the_budget(inputs):
    state = state_with([1, 2, 3], budget=8)
    cases = [
        (session_pb2.AppendObservationRequest(), "needs text, token_ids or messages"),
        (session_pb2.AppendObservationRequest(text=""), "the observation is empty"),
        (session_pb2.AppendObservationRequest(token_ids=common_pb2.TokenIds(ids=[-1])),
         "outside the vocabulary"),
        (session_pb2.AppendObservationRequest(token_ids=common_pb2.TokenIds(ids=[5] * 6)),
         "more than the 5 that fit"),
        (session_pb2.AppendObservationRequest(text="12 34 56 78"),
         "only 5 of the session's 8-token budget remain"),
    ]
    for request, message in cases:
        with pytest.raises(InvalidSessionRequest, match=message):
            inputs.observation_ids(request, state)
    tool = session_pb2.AppendObservationRequest(messages=common_pb2.ChatMessages(
        messages=[common_pb2.ChatMessage(role="tool", content="5")]), add_generation_prompt=False)
    assert inputs.tokenizer.decode(inputs.observation_ids(tool, state_with([1], budget=64))) == "tool\n5\n"


def test_oversized_metadata_is_refused(inputs):
    assert inputs.metadata({"a": "b"}) == {"a": "b"}
    with pytest.raises(InvalidSessionRequest, match="more than max_metadata_bytes"):
        inputs.metadata({"key": "v" * 30})


def test_oversize_inputs_are_refused_with_the_limit_before_they_are_tokenized(inputs):
    def never(text):
        raise AssertionError("tokenized an oversize input")

    inputs.tokenizer.encode = never
    state = state_with([1, 2], budget=20)
    cases = [
        (inputs.observation_ids_off_loop(session_pb2.AppendObservationRequest(text="x" * 101), state),
         "text", 100),
        (inputs.observation_ids_off_loop(session_pb2.AppendObservationRequest(messages=common_pb2.ChatMessages(
            messages=[common_pb2.ChatMessage(role="user", content="y" * 101)])), state), "messages", 100),
        (inputs.observation_ids_off_loop(session_pb2.AppendObservationRequest(
            token_ids=common_pb2.TokenIds(ids=[5] * 19)), state), "token_ids", 18),
        (inputs.prompt_ids_off_loop(session_pb2.OpenSessionRequest(messages=common_pb2.ChatMessages(
            messages=[common_pb2.ChatMessage(role="user", content="z" * 101)])), 10), "messages", 100),
    ]
    for call, field, limit in cases:
        with pytest.raises(InvalidSessionRequest) as refused:
            asyncio.run(call)
        assert refused.value.field == field and refused.value.details["limit"] == limit, refused.value
        assert refused.value.details["size"] > limit


def test_a_long_text_is_tokenized_off_the_event_loop_while_other_sessions_go_on(tokenizer_dir):
    """Eight near-limit observations tokenizing at once (seconds of work) do not hold up a small one."""
    limits = Limits(context_length=None, default_budget=1 << 22, max_text_chars=1 << 20,
                    max_metadata_bytes=20)
    inputs = Inputs(Tokenizer(str(tokenizer_dir)), load_chat_renderer(str(tokenizer_dir), "auto"), limits)
    big_text = "12 + 34 = 46, what is 7*8? " * 4000  # 108,000 characters each

    async def main():
        big_state, small_state = state_with([1], budget=1 << 22), state_with([1], budget=100)
        big = [asyncio.ensure_future(inputs.observation_ids_off_loop(
            session_pb2.AppendObservationRequest(text=big_text), big_state)) for _ in range(8)]
        await asyncio.sleep(0.05)
        small = await inputs.observation_ids_off_loop(session_pb2.AppendObservationRequest(text="1 + 1"),
                                                      small_state)
        still_busy = sum(not b.done() for b in big)
        done = await asyncio.gather(*big)
        return small, still_busy, done

    small, still_busy, done = asyncio.run(main())
    assert small == inputs.tokenizer.encode("1 + 1") and still_busy > 0
    assert all(ids == done[0] for ids in done) and len(done[0]) > 1000
