"""The observation between two turns keeps the session's tokens equal to the rendered conversation's."""

import pytest

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.session.v1 import session_pb2
from rlfleet.common.chat import IM_END, render_messages
from rlfleet.envkit.sdk.framing import ChatMLFraming
from rlfleet.envkit.suites import calc
from rlfleet.envkit.testing import build_tokenizer

PROMPT = [{"role": "system", "content": calc.SYSTEM_PROMPT}, {"role": "user", "content": "What is 37*48+5?"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer

    directory = build_tokenizer(tmp_path_factory.mktemp("tok"))
    return Tokenizer.from_file(str(directory / "tokenizer.json"))


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False).ids


def reply(ids, finish=common_pb2.FINISH_REASON_STOP, text=""):
    return session_pb2.GenerateResponse(token_ids=ids, finish_reason=finish, text=text)


def play(tokenizer, framing, turns):
    """The session's tokens for `turns` [(assistant text, ends with <|im_end|>, observation or None)]."""
    end = tokenizer.token_to_id(IM_END)
    ids = encode(tokenizer, render_messages(PROMPT, add_generation_prompt=True))
    framing.learn_prompt(ids)
    for text, closed, observation in turns:
        generated = encode(tokenizer, text) + ([end] if closed else [])
        ids += generated
        if observation is not None:
            finish = common_pb2.FINISH_REASON_STOP if closed else common_pb2.FINISH_REASON_LENGTH
            ids += encode(tokenizer, framing.observation(reply(generated, finish), observation))
    return ids


def test_the_prompt_teaches_the_framing_the_end_of_turn_token(tokenizer):
    framing = ChatMLFraming()
    framing.learn_prompt(encode(tokenizer, render_messages(PROMPT, add_generation_prompt=True)))
    assert framing.end_of_turn_id == tokenizer.token_to_id(IM_END)


def test_a_whole_episode_tokenizes_like_the_template_renders_the_conversation(tokenizer):
    session = play(tokenizer, ChatMLFraming(), [("<calc>37*48+5</calc>", True, "1781"),
                                                ("<answer>1781</answer>", True, None)])
    conversation = [*PROMPT, {"role": "assistant", "content": "<calc>37*48+5</calc>"},
                             {"role": "tool", "content": "1781"},
                             {"role": "assistant", "content": "<answer>1781</answer>"}]
    rendered = render_messages(conversation, add_generation_prompt=False)
    # The session ends at the model's <|im_end|>; the template adds a newline after it.
    assert session == encode(tokenizer, rendered.removesuffix("\n"))


def test_a_turn_cut_at_max_new_tokens_is_closed_by_the_observation(tokenizer):
    session = play(tokenizer, ChatMLFraming(), [("<calc>37*4", False, "error: malformed tool call: "
                                                 "<calc> is not closed by </calc>"),
                                                ("<answer>1</answer>", True, None)])
    conversation = [*PROMPT, {"role": "assistant", "content": "<calc>37*4"},
                             {"role": "tool",
                              "content": "error: malformed tool call: <calc> is not closed by </calc>"},
                             {"role": "assistant", "content": "<answer>1</answer>"}]
    assert session == encode(tokenizer,
                             render_messages(conversation, add_generation_prompt=False).removesuffix("\n"))


def test_an_observation_is_one_tool_message_that_opens_the_next_assistant_turn():
    framing = ChatMLFraming()
    text = framing.observation(reply([], common_pb2.FINISH_REASON_STOP), "1781")
    assert text == "\n<|im_start|>tool\n1781<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(("finish", "opener"), [(common_pb2.FINISH_REASON_STOP, "\n<|im_start|>"),
                                                (common_pb2.FINISH_REASON_LENGTH,
                                                 "<|im_end|>\n<|im_start|>")])
def test_without_token_ids_the_finish_reason_decides_whether_the_turn_is_closed(finish, opener):
    assert ChatMLFraming().observation(reply([], finish), "x").startswith(opener)


def test_a_turn_ending_in_another_token_than_the_end_of_turn_is_closed_by_the_observation(tokenizer):
    framing = ChatMLFraming()
    framing.learn_prompt(encode(tokenizer, render_messages(PROMPT, add_generation_prompt=True)))
    eos = tokenizer.token_to_id("<|endoftext|>")
    text = framing.observation(reply([5, 6, eos], common_pb2.FINISH_REASON_STOP), "1781")
    assert text.startswith(IM_END + "\n")
