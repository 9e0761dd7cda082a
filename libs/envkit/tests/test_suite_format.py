import json

import pytest

from rlfleet.envkit.errors import SuiteFormatError
from rlfleet.envkit.suite_format import (
    VERIFIER_KINDS,
    Task,
    hidden_view,
    load_suite,
    parse_task_line,
    public_view,
    task_to_line,
    write_suite,
)
from rlfleet.envkit.suites import calc, code

MINIMAL = {
    "task_id": "t1",
    "suite": "mine",
    "split": "train",
    "prompt": "Say hi",
    "verifier": {"kind": "exact", "answer": "hi"},
}


def _line(**changes):
    record = {**MINIMAL, **changes}
    return json.dumps({k: v for k, v in record.items() if v is not None})


def _write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_built_in_suites_round_trip_through_jsonl(tmp_path):
    tasks = calc.generate_tasks("train", 20, difficulty=3) + code.generate_tasks("heldout")
    assert write_suite(tasks, tmp_path / "suites" / "mixed.jsonl") == len(tasks)
    assert load_suite(tmp_path / "suites" / "mixed.jsonl") == tasks


def test_a_minimal_hand_written_line_gets_defaults_and_its_prompt_becomes_a_user_message():
    task = parse_task_line(_line())
    assert task.schema_version == 1 and task.tools == () and task.limits.max_turns == 4
    assert task.chat_messages() == [{"role": "user", "content": "Say hi"}]


def test_public_view_has_the_prompt_tools_and_limits_and_nothing_the_verifier_keeps():
    task = code.generate_tasks("train", 1)[0]
    public, hidden = public_view(task), hidden_view(task)
    assert set(public) == {"schema_version", "task_id", "suite", "split", "messages", "tools",
                           "limits", "workspace"}
    assert public["messages"][1]["content"].startswith("Write a Python function")
    assert "CASES" not in json.dumps(public) and "RESULT passed" not in json.dumps(public)
    assert set(hidden) == {"task_id", "suite", "verifier", "metadata"}
    assert hidden["verifier"]["kind"] == "unit_tests" and "CASES" in hidden["verifier"]["tests"]


def test_public_view_of_a_calc_task_does_not_contain_the_answer():
    task = calc.generate_tasks("heldout", 1, difficulty=2)[0]
    assert task.verifier.answer not in json.dumps(public_view(task))
    assert hidden_view(task)["verifier"]["answer"] == task.verifier.answer


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"task_id": "t1", ', "invalid JSON: Expecting property name enclosed in double quotes (column 19)"),
        ("[1, 2]", "expected a JSON object, got list"),
        (_line(task_id=None), "task_id: Field required"),
        (
            _line(verifier={"kind": "regex", "pattern": "h.*"}),
            "verifier.kind: unknown verifier kind 'regex' (known: exact, numeric, unit_tests)",
        ),
        (_line(difficulty=2), "difficulty: Extra inputs are not permitted"),
        (
            _line(verifier={"kind": "exact", "answer": "hi", "tolerance": 1}),
            "verifier.tolerance: Extra inputs are not permitted",
        ),
        (
            _line(verifier={"kind": "numeric", "answer": "many"}),
            "verifier.answer: Value error, answer 'many' is not a finite number",
        ),
        (_line(verifier={"kind": "unit_tests"}), "verifier.tests: Field required"),
        (_line(verifier={"answer": "hi"}), "verifier: Unable to extract tag using discriminator 'kind'"),
        (_line(split="dev"), "split: Input should be 'train', 'heldout' or 'regression'"),
        (
            _line(messages=[{"role": "user", "content": "hi"}]),
            "task: Value error, give exactly one of 'prompt' and 'messages'",
        ),
        (_line(prompt=None), "task: Value error, give exactly one of 'prompt' and 'messages'"),
        (
            _line(prompt=None, messages=[{"role": "robot", "content": "x"}]),
            "messages.0.role: Input should be",
        ),
        (_line(tools=[{"name": "answer"}]), "tools.0.name: Value error, 'answer' is reserved"),
        (_line(limits={"max_turns": -1}), "limits.max_turns: Input should be greater than or equal to 0"),
    ],
)
def test_a_malformed_line_is_reported_with_its_line_number_and_what_is_wrong(tmp_path, text, message):
    path = _write_lines(tmp_path / "suite.jsonl", [_line(task_id="ok"), "", text])
    with pytest.raises(SuiteFormatError) as caught:
        load_suite(path)
    assert caught.value.line == 3
    assert caught.value.message.startswith(message)
    assert str(caught.value).startswith(f"{path}:3: ")


def test_a_duplicate_task_id_names_both_lines(tmp_path):
    path = _write_lines(tmp_path / "suite.jsonl", [_line(), _line()])
    with pytest.raises(SuiteFormatError, match=r":2: duplicate task_id 't1' \(first on line 1\)"):
        load_suite(path)


def test_every_verifier_kind_has_a_model_and_only_those_are_accepted():
    specs = {"exact": {"answer": "a"}, "numeric": {"answer": "1,781"}, "unit_tests": {"tests": "assert True"}}
    assert set(specs) == set(VERIFIER_KINDS)
    for kind, params in specs.items():
        assert parse_task_line(_line(verifier={"kind": kind, **params})).verifier.kind == kind


def test_written_lines_omit_unset_optional_keys():
    line = json.loads(task_to_line(Task.model_validate(MINIMAL)))
    assert "messages" not in line and line["prompt"] == "Say hi"


def test_the_command_line_writes_a_built_in_split_that_loads_back(tmp_path, capsys):
    from rlfleet.envkit.suites.__main__ import main

    assert main(["calc", "heldout", "25", str(tmp_path / "calc.jsonl"), "--difficulty", "2"]) == 0
    assert load_suite(tmp_path / "calc.jsonl") == calc.generate_tasks("heldout", 25, difficulty=2)
    assert "wrote 25 calc/heldout tasks" in capsys.readouterr().out
