"""Chat-message observations are framed so that a session's tokens are exactly what the model's
chat template renders for the whole conversation (`apply_chat_template`), for every model family
rlfleet builds: after a turn that ended on its stop token, and after a turn cut short, which the
observation closes."""

from __future__ import annotations

import pytest

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.gateway.v1 import gateway_pb2
from rlfleet.api.session.v1 import session_pb2
from rlfleet.common.families import FAMILIES
from rlfleet.common.tool_calls import tool_call_format
from rlfleet.engine.build_model import write_tokenizer
from rlfleet.engine.testing import calc_dialogues
from rlfleet.session.inputs import Inputs, Limits
from rlfleet.session.state import SessionState, append_generated, append_observation, append_prompt
from rlfleet.session.text import Tokenizer, load_chat_renderer

# The token each family's template closes an assistant turn with.
END_OF_TURN = {"qwen2": "<|im_end|>", "qwen3": "<|im_end|>", "llama": "<|eot_id|>", "mistral": "</s>"}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"tokenizer-{request.param}")
    write_tokenizer(out, calc_dialogues(200), 400, 1024, FAMILIES[request.param])
    return request.param, out


def chat(*messages: tuple[str, str]) -> common_pb2.ChatMessages:
    return common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role=r, content=c) for r, c in messages])


@pytest.mark.parametrize("first_turn_cut", [False, True], ids=["stopped", "cut"])
def test_observations_after_each_kind_of_turn_render_the_whole_conversation(family_dir, first_turn_cut):
    from transformers import AutoTokenizer

    name, path = family_dir
    family = FAMILIES[name]
    inputs = Inputs(Tokenizer(str(path)), load_chat_renderer(str(path), "auto"),
                    Limits(context_length=None, default_budget=4096, max_text_chars=1 << 16,
                           max_metadata_bytes=1024))
    tokenizer = inputs.tokenizer
    # Mistral's template moves the system prompt to the last user turn, so no conversation with
    # one is a prefix of its continuation; its episodes start without one.
    opening = [] if name == "mistral" else [("system", "You are a calculator agent.")]
    opening.append(("user", "What is 2+3?"))
    call = tool_call_format(family.tool_call_format).render("calc", {"expression": "2+3"})
    turns = [call, "The result is <answer>5"]  # the second one is always cut (max_new_tokens)
    observations = [(("tool", "5"),), (("user", "And 4*4?"),)]

    state = SessionState(session=session_pb2.Session(session_id="s", max_total_tokens=4096))
    prompt = inputs.prompt_ids(session_pb2.OpenSessionRequest(messages=chat(*opening)), 4096)
    append_prompt(state, prompt)
    for index, (content, observation) in enumerate(zip(turns, observations, strict=True)):
        ids = tokenizer.encode(content)
        stopped = index == 0 and not first_turn_cut
        if stopped:
            ids.append(family.special_tokens.index(END_OF_TURN[name]))
        reply = gateway_pb2.GenerateResponse(
            output_ids=ids, output_logprobs=[-1.0] * len(ids),
            finish_reason=common_pb2.FINISH_REASON_STOP if stopped else common_pb2.FINISH_REASON_LENGTH)
        append_generated(state, reply, 1.0)
        request = session_pb2.AppendObservationRequest(messages=chat(*observation),
                                                       add_generation_prompt=True)
        append_observation(state, inputs.observation_ids(request, state), 2.0)

    conversation = [{"role": r, "content": c} for r, c in opening]
    for content, observation in zip(turns, observations, strict=True):
        conversation.append({"role": "assistant", "content": content})
        conversation.extend({"role": r, "content": c} for r, c in observation)
    auto = AutoTokenizer.from_pretrained(str(path))
    expected = auto.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True,
                                        return_dict=False)
    assert tokenizer.decode(list(state.session.token_ids), skip_special_tokens=False) == auto.decode(expected)
    assert list(state.session.token_ids) == list(expected)
