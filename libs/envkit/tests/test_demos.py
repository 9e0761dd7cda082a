import json
import re

import pytest

from rlfleet.envkit.actions import FinalAnswer, InvalidCall, ToolCall, parse_action
from rlfleet.envkit.demos import FLAWS, generate_demos, main
from rlfleet.envkit.suites import calc


def _expression(demo):
    return re.fullmatch(r"What is (.+)\?", demo["messages"][1]["content"])[1]


def _assistant_turns(demo):
    return [m["content"] for m in demo["messages"] if m["role"] == "assistant"]


def _final_answer(demo):
    action = parse_action(_assistant_turns(demo)[-1], ["calc"])
    return action.answer if isinstance(action, FinalAnswer) else None


def test_demos_are_deterministic_and_json_ready():
    demos = generate_demos(100, seed=4, imperfection=0.5)
    assert demos == generate_demos(100, seed=4, imperfection=0.5)
    assert set(demos[0]) == {"messages", "task_id", "flaw"}
    assert all(isinstance(m["content"], str) for d in demos for m in d["messages"])


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_perfect_demos_call_the_tool_with_the_expression_and_answer_its_result(difficulty):
    for demo in generate_demos(200, seed=1, imperfection=0.0, difficulty=difficulty):
        expression = _expression(demo)
        roles = [m["role"] for m in demo["messages"]]
        assert roles == ["system", "user", "assistant", "tool", "assistant"]
        assert demo["flaw"] == "none"
        assert parse_action(demo["messages"][2]["content"], ["calc"]) == ToolCall("calc", expression)
        assert demo["messages"][3]["content"] == str(eval(expression))
        assert _final_answer(demo) == str(eval(expression))


def test_half_imperfect_demos_carry_a_flaw_about_half_the_time_and_end_right_about_sixty_percent():
    demos = generate_demos(2000, seed=2, imperfection=0.5)
    flawed = sum(d["flaw"] != "none" for d in demos) / len(demos)
    right = sum(_final_answer(d) == str(eval(_expression(d))) for d in demos) / len(demos)
    assert 0.45 <= flawed <= 0.55
    assert 0.54 <= right <= 0.66
    assert {d["flaw"] for d in demos} == {"none", *FLAWS}


def test_each_flaw_shows_the_behaviour_it_is_named_after():
    for demo in generate_demos(600, seed=3, imperfection=1.0, difficulty=2):
        expression, answer = _expression(demo), str(eval(_expression(demo)))
        turns = _assistant_turns(demo)
        first = parse_action(turns[0], ["calc"])
        if demo["flaw"] == "no_tool":
            assert len(turns) == 1 and isinstance(first, FinalAnswer)
        elif demo["flaw"] == "wrong_expression":
            assert isinstance(first, ToolCall) and first.args != expression
            assert demo["messages"][3]["content"] == calc.tool_observation(first.args)
            assert _final_answer(demo) != answer
        elif demo["flaw"] == "malformed_call":
            assert isinstance(first, InvalidCall)
            assert demo["messages"][3]["content"] == first.error
        else:
            assert demo["flaw"] == "answer_typo"
            assert first == ToolCall("calc", expression)
            assert demo["messages"][3]["content"] == answer != _final_answer(demo)


def test_demos_only_use_train_tasks():
    train_ids = {t.task_id for t in calc.generate_tasks("train", 300, seed=9)}
    assert {d["task_id"] for d in generate_demos(300, seed=9, imperfection=0.3)} == train_ids


def test_imperfection_outside_the_unit_interval_is_rejected():
    with pytest.raises(ValueError, match="imperfection"):
        generate_demos(1, imperfection=1.5)


def test_the_command_line_writes_demos_as_jsonl(tmp_path):
    assert main(["30", str(tmp_path / "d" / "demos.jsonl"), "--imperfection", "0.2", "--seed", "3"]) == 0
    lines = (tmp_path / "d" / "demos.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == generate_demos(30, seed=3, imperfection=0.2)
