"""From session tokens or a transcript to an Episode: turns, tool calls paired with their observations."""

from __future__ import annotations

import pytest

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.session.v1 import session_pb2
from rlfleet.envkit import actions
from rlfleet.verifier.kinds import ToolCallRecord, default_kinds
from rlfleet.verifier.kinds.turns import offered_call
from rlfleet.verifier.transcript import (
    Turn,
    episode_from_turns,
    observation_turns,
    session_truncated,
    turns_from_session,
    turns_from_text,
)

TASK = {"task_id": "t", "suite": "calc", "verifier": {"kind": "numeric", "answer": "1781"},
        "tools": [{"name": "calc"}], "limits": {"max_turns": 2}}


class CharDecoder:
    """Token i is chr(i): enough to check which spans are decoded how."""

    def decode(self, ids, *, keep_special: bool) -> str:
        text = "".join(map(chr, ids))
        return text if keep_special else text.replace("<|im_end|>", "").replace("<|im_start|>", "")


def session(*spans: tuple[int, str], finish=common_pb2.FINISH_REASON_STOP,
            budget: int = 0) -> session_pb2.Session:
    s = session_pb2.Session(max_total_tokens=budget)
    for kind, text in spans:
        start = len(s.token_ids)
        s.token_ids.extend(map(ord, text))
        s.spans.append(common_pb2.Span(kind=kind, start=start, end=len(s.token_ids), finish_reason=finish))
    return s


PROMPT, GEN, OBS = (common_pb2.SPAN_KIND_PROMPT, common_pb2.SPAN_KIND_GENERATED,
                    common_pb2.SPAN_KIND_OBSERVATION)


def test_generated_spans_are_assistant_turns_and_observations_are_read_as_tool_messages():
    s = session((PROMPT, "<|im_start|>user\nWhat is 37*48+5?<|im_end|>\n<|im_start|>assistant\n"),
                (GEN, "<calc>37*48+5</calc><|im_end|>"),
                (OBS, "\n<|im_start|>tool\n1781<|im_end|>\n<|im_start|>assistant\n"),
                (GEN, "<answer>17"), (GEN, "81</answer><|im_end|>"))
    turns = turns_from_session(s, CharDecoder())
    assert turns == [Turn("assistant", "<calc>37*48+5</calc>"), Turn("tool", "1781"),
                     Turn("assistant", "<answer>1781</answer>")]  # consecutive generated spans are one turn
    episode = episode_from_turns(turns, TASK)
    assert episode.tool_calls == [ToolCallRecord("calc", "37*48+5", "1781", ok=True)]
    assert default_kinds().score(TASK, episode).passed


def test_an_observation_without_chat_markup_is_one_tool_message():
    assert (observation_turns("  error: division by zero<|im_end|>\n")
            == [Turn("tool", "error: division by zero")])
    assert observation_turns("<|im_start|>user\nand now?<|im_end|>") == [Turn("user", "and now?")]


def test_a_call_answered_with_an_error_is_a_failed_call_and_unoffered_tools_get_no_record():
    turns = [Turn("assistant", "<calculator>1</calculator>"),
             Turn("tool", "error: unknown tool 'calculator'"),
             Turn("assistant", "<calc>1/0</calc>"), Turn("tool", "error: division by zero"),
             Turn("assistant", "<calc>37*48+5</calc>"), Turn("tool", "1781"),
             Turn("assistant", "<answer>1781</answer>")]
    episode = episode_from_turns(turns, TASK)
    assert [r.ok for r in episode.tool_calls] == [False, True]
    verdict = default_kinds().score(TASK, episode)
    assert verdict.passed and verdict.reward == pytest.approx(0.9) and len(verdict.reasons) == 2


def test_a_session_is_truncated_when_its_last_turn_hit_the_length_limit_or_the_budget_is_spent():
    assert session_truncated(session((PROMPT, "p"), (GEN, "<calc>1"), finish=common_pb2.FINISH_REASON_LENGTH))
    assert session_truncated(session((PROMPT, "p"), (GEN, "abc"), budget=4))
    assert not session_truncated(session((PROMPT, "p"), (GEN, "abc"), budget=100))


def test_a_chatml_transcript_is_split_into_turns_and_plain_text_is_one_assistant_turn():
    text = ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>assistant\n<calc>2+2</calc><|im_end|>\n"
            "<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\n<answer>4</answer><|im_end|>\n")
    assert turns_from_text(text) == [Turn("assistant", "<calc>2+2</calc>"), Turn("tool", "4"),
                                     Turn("assistant", "<answer>4</answer>")]
    assert turns_from_text("<answer>4</answer>") == [Turn("assistant", "<answer>4</answer>")]
    assert turns_from_text("") == []


@pytest.mark.parametrize("turn", ["<calc>1+2</calc>", "<calc>1+2", "1+2</calc>", "<python>x</python>",
                                  "no tags", "<answer>1</answer><calc>2</calc>",
                                  "<calc>2</calc><answer>1</answer>"])
def test_a_turn_is_a_call_to_run_exactly_when_the_rollout_worker_runs_it(turn):
    action = actions.parse_action(turn, ["calc"])
    expected = (action.tool, action.args) if isinstance(action, actions.ToolCall) else None
    assert offered_call(turn, ["calc"]) == expected


@pytest.mark.parametrize("observation", [
    # as the session server frames a tool result after a turn that ended on its stop token
    "\n<|im_start|>user\n<tool_response>\nerror: division by zero\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n",
    "<|start_header_id|>ipython<|end_header_id|>\n\nerror: division by zero<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    '[TOOL_RESULTS] {"content": "error: division by zero"}[/TOOL_RESULTS]',
], ids=["hermes", "llama3", "mistral"])
def test_tool_results_framed_by_other_families_templates_are_read_as_tool_messages(observation):
    assert observation_turns(observation) == [Turn("tool", "error: division by zero")]


def test_user_turns_of_other_families_are_user_messages():
    assert observation_turns("<|start_header_id|>user<|end_header_id|>\n\nand now?<|eot_id|>") == [
        Turn("user", "and now?")]
    assert observation_turns('[TOOL_RESULTS] {"content": "5"}[/TOOL_RESULTS][INST] and now?[/INST]') == [
        Turn("tool", "5"), Turn("user", "and now?")]
