import subprocess
import sys

import pytest

from rlfleet.envkit.suites import code
from rlfleet.envkit.suites.code_templates import TEMPLATES


def _run_hidden_tests(task, solution, tmp_path):
    """Runs the hidden script next to a solution, as the verifier's sandbox would (no isolation here)."""
    (tmp_path / code.SOLUTION_FILE).write_text(solution)
    (tmp_path / task.verifier.test_file).write_text(task.verifier.tests)
    return subprocess.run(
        [sys.executable, "-I", task.verifier.test_file],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_suite_has_twenty_to_forty_tasks_split_deterministically_into_train_and_heldout():
    train, heldout = code.generate_tasks("train"), code.generate_tasks("heldout")
    assert 20 <= len(train) + len(heldout) == len(TEMPLATES) <= 40
    assert len(heldout) >= 5
    assert not {t.task_id for t in train} & {t.task_id for t in heldout}
    assert code.generate_tasks("train", seed=1) == code.generate_tasks("train", seed=1)
    assert code.generate_tasks("train", 5, seed=2) == code.generate_tasks("train", seed=2)[:5]


def test_task_names_the_signature_the_file_and_the_tools_but_not_the_tests():
    task = code.generate_tasks("train", 1)[0]
    prompt = task.messages[-1].content
    assert task.metadata["signature"] in prompt and code.SOLUTION_FILE in prompt
    assert task.tool_names == ["write_file", "python"]
    assert task.verifier.solution_files == (code.SOLUTION_FILE,)
    assert "CASES" not in prompt


def test_every_reference_solution_passes_its_hidden_tests(tmp_path):
    for task in code.generate_tasks("train") + code.generate_tasks("heldout"):
        workdir = tmp_path / task.task_id
        workdir.mkdir()
        result = _run_hidden_tests(task, code.reference_solution(task), workdir)
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.splitlines()[-1].endswith(" failed=0")


def test_a_wrong_solution_fails_with_one_named_line_per_failing_test(tmp_path):
    task = code.make_task(next(t for t in TEMPLATES if t.function == "fizzbuzz"))
    result = _run_hidden_tests(task, "def fizzbuzz(n):\n    return str(n)\n", tmp_path)
    assert result.returncode == 1
    fails = [line for line in result.stdout.splitlines() if line.startswith("FAIL ")]
    assert fails[0] == "FAIL test_fizzbuzz_0: fizzbuzz(3,) returned '3', expected 'Fizz'"
    assert result.stdout.splitlines()[-1] == "RESULT passed=1 failed=4"


@pytest.mark.parametrize(
    "solution",
    ["def other():\n    pass\n", "import sys\nsys.exit(0)\n", "raise RuntimeError('boom')\n"],
)
def test_a_solution_that_cannot_be_imported_or_exits_early_fails_the_import_test(tmp_path, solution):
    task = code.make_task(TEMPLATES[0])
    result = _run_hidden_tests(task, solution, tmp_path)
    assert result.returncode == 1
    assert result.stdout.startswith("FAIL import_solution: ")


def test_regression_split_and_other_difficulties_do_not_exist():
    with pytest.raises(ValueError, match="train and heldout"):
        code.generate_tasks("regression")
    with pytest.raises(ValueError, match="single difficulty"):
        code.generate_tasks("train", difficulty=2)
