import re

import pytest

from rlfleet.envkit.actions import FinalAnswer, ToolCall, parse_action
from rlfleet.envkit.errors import TaskGenerationError
from rlfleet.envkit.suites import calc, generate_tasks


def _expression(task):
    return re.fullmatch(r"What is (.+)\?", task.messages[-1].content)[1]


def test_same_arguments_generate_the_same_tasks():
    assert calc.generate_tasks("train", 50, seed=3, difficulty=2) == calc.generate_tasks(
        "train", 50, seed=3, difficulty=2
    )


def test_different_seeds_generate_different_train_tasks():
    first = {t.task_id for t in calc.generate_tasks("train", 50, seed=1)}
    second = {t.task_id for t in calc.generate_tasks("train", 50, seed=2)}
    assert len(first & second) < 10


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_splits_are_disjoint_and_every_task_is_in_the_split_it_claims(difficulty):
    splits = {
        split: calc.generate_tasks(split, 300, seed=7, difficulty=difficulty)
        for split in ("train", "heldout", "regression")
    }
    expressions = {split: {_expression(t) for t in tasks} for split, tasks in splits.items()}
    assert not expressions["train"] & expressions["heldout"]
    assert not expressions["train"] & expressions["regression"]
    assert not expressions["heldout"] & expressions["regression"]
    for split, tasks in splits.items():
        assert len(expressions[split]) == 300
        assert all(t.split == split == calc.split_of(_expression(t)) for t in tasks)


def test_regression_set_ignores_the_seed_and_a_longer_request_extends_it():
    short = calc.generate_tasks("regression", 20, seed=1)
    assert calc.generate_tasks("regression", 20, seed=99) == short
    assert calc.generate_tasks("regression", 40, seed=5)[:20] == short


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_every_task_answer_matches_pythons_own_arithmetic(difficulty):
    for split in ("train", "heldout", "regression"):
        for task in calc.generate_tasks(split, 200, seed=11, difficulty=difficulty):
            expression = _expression(task)
            assert task.metadata["expression"] == expression
            assert task.verifier.kind == "numeric"
            assert task.verifier.answer == str(eval(expression))  # the generator uses + - * only


def test_difficulty_controls_operator_count_operand_size_and_parentheses():
    def operands(task):
        return [int(x) for x in re.findall(r"\d+", _expression(task))]

    level1 = calc.generate_tasks("train", 100, difficulty=1)
    assert all(len(operands(t)) == 2 and all(10 <= x <= 99 for x in operands(t)) for t in level1)
    level2 = calc.generate_tasks("train", 100, difficulty=2)
    assert all(len(operands(t)) == 3 and "(" not in _expression(t) for t in level2)
    assert any(x >= 100 for t in level2 for x in operands(t))
    level3 = calc.generate_tasks("train", 100, difficulty=3)
    assert all("(" in _expression(t) for t in level3)


def test_task_offers_only_the_calc_tool_and_a_short_system_prompt():
    task = calc.generate_tasks("heldout", 1)[0]
    assert [m.role for m in task.messages] == ["system", "user"]
    assert task.tool_names == ["calc"]
    assert len(calc.SYSTEM_PROMPT) < 160
    assert task.task_id.startswith("calc-1-")


def test_ideal_episode_is_a_tool_call_then_the_tools_result_as_answer():
    task = calc.generate_tasks("train", 1, difficulty=3)[0]
    expression = task.metadata["expression"]
    action = parse_action(f"<calc>{expression}</calc>", task.tool_names)
    assert action == ToolCall("calc", expression)
    observation = calc.tool_observation(action.args)
    assert parse_action(f"<answer>{observation}</answer>", task.tool_names) == FinalAnswer(
        task.verifier.answer
    )


def test_unknown_split_or_difficulty_is_an_error():
    with pytest.raises(ValueError, match="unknown split"):
        calc.generate_tasks("test", 1)
    with pytest.raises(ValueError, match="unknown difficulty"):
        calc.generate_tasks("train", 1, difficulty=4)
    with pytest.raises(ValueError, match="unknown suite"):
        generate_tasks("chess", "train", 1)


def test_asking_for_more_distinct_tasks_than_the_split_holds_is_a_typed_error():
    # Level 1 has 3 * 90 * 90 expressions, about 5% of them in the regression split.
    with pytest.raises(TaskGenerationError, match="distinct regression tasks"):
        calc.generate_tasks("regression", 2000, difficulty=1)
