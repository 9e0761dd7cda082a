import json
import secrets
import subprocess
import sys

import pytest

from rlfleet.envkit.actions import ToolCall
from rlfleet.envkit.sdk.environment import EDIT_SCRIPT, RepoEnvironment
from rlfleet.envkit.suite_format import parse_task_line, public_view, task_to_line
from rlfleet.envkit.suites import generate_tasks, repo
from rlfleet.envkit.suites.repo_templates import FUNCTIONS
from rlfleet.envkit.tasks import decode_task, task_message, workspace_of

unit_tests = pytest.importorskip("rlfleet.verifier.kinds.unit_tests")


def _hidden_verdict(task, files):
    """The supervised harness's verdict on `files` (run locally: the harness's shape without a sandbox)."""
    spec = task.verifier.model_dump()
    nonce = secrets.token_hex(8)
    solution = {path: files[path] for path in task.verifier.solution_files if path in files}
    result = unit_tests.run_locally(unit_tests.harness_request(spec, solution, nonce))
    return unit_tests.judge(result, nonce, spec["tests"], spec["timeout_s"])


@pytest.mark.parametrize("level", repo.LEVELS)
def test_splits_are_disjoint_deterministic_and_the_regression_set_ignores_the_seed(level):
    train = repo.generate_tasks("train", 200, seed=1, difficulty=level)
    heldout = repo.generate_tasks("heldout", 40, seed=1, difficulty=level)
    regression = repo.generate_tasks("regression", 10, seed=1, difficulty=level)
    ids = [{t.task_id for t in tasks} for tasks in (train, heldout, regression)]
    assert all(len(s) == n for s, n in zip(ids, (200, 40, 10), strict=True))
    assert not ids[0] & ids[1] and not ids[0] & ids[2] and not ids[1] & ids[2]
    assert repo.generate_tasks("train", 200, seed=1, difficulty=level) == train
    assert repo.generate_tasks("regression", 10, seed=9, difficulty=level) == regression
    assert {t.metadata["function"] for t in heldout} <= {t.metadata["function"] for t in train}


def test_a_task_names_its_failure_modes_and_keeps_the_hidden_tests_out_of_the_public_view():
    task = repo.generate_tasks("train", 1, difficulty=1)[0]
    assert task.metadata["failure_modes"][0] == task.metadata["bug"] != "not_implemented"
    assert set(repo.GENERIC_FAILURE_MODES) <= set(task.metadata["failure_modes"])
    public = json.dumps(public_view(task))
    assert "RESULT passed" not in public and "CASES" not in public and task.metadata["bug"] not in public
    assert task.verifier.test_file not in task.workspace
    assert parse_task_line(task_to_line(task)) == task  # the workspace survives the suite file


def test_the_workspace_travels_in_the_task_message_and_back():
    task = repo.generate_tasks("heldout", 1, difficulty=2)[0]
    message = task_message(task, run_id="r")
    assert workspace_of(decode_task(message.SerializeToString(), "r", ["repo"])) == task.workspace
    assert len(task.workspace) == 3 and task.metadata["helper"] + ".py" in task.workspace


@pytest.mark.parametrize("level", repo.LEVELS)
def test_the_reference_fix_passes_the_hidden_tests_and_the_starting_workspace_fails_them(level):
    for task in repo.generate_tasks("train", 4, seed=3, difficulty=level):
        assert _hidden_verdict(task, repo.fixed_workspace(task)) == []
        reasons = _hidden_verdict(task, dict(task.workspace))
        assert reasons and all(r.code.name in ("WRONG_ANSWER", "EXCEPTION") for r in reasons)


def test_every_function_reference_passes_its_hidden_and_visible_cases_and_every_bug_fails_one(tmp_path):
    for function in FUNCTIONS:
        namespace: dict = {}
        exec(function.source(), namespace)
        for args, expected in function.visible + function.hidden:
            got = namespace[function.name](*args)
            assert got == expected and type(got) is type(expected), (function.name, args)
        for bug in function.bugs:
            assert bug.line in function.body.split("\n"), (function.name, bug)
            buggy: dict = {}
            exec(function.source(bug), buggy)
            assert any(buggy[function.name](*a) != e for a, e in function.hidden), (function.name, bug.kind)


def test_the_visible_test_command_fails_before_the_fix_and_passes_after(tmp_path):
    task = repo.generate_tasks("train", 1, seed=5, difficulty=1)[0]
    for files, status in ((task.workspace, 1), (repo.fixed_workspace(task), 0)):
        for path, text in files.items():
            (tmp_path / path).write_text(text)
        done = subprocess.run([sys.executable, task.metadata["test_file"]], cwd=tmp_path, capture_output=True,
                              text=True, timeout=30)
        assert done.returncode == status, done.stdout


def _edit(tmp_path, path, old, new):
    done = subprocess.run([sys.executable, "-I", "-S", "-c", EDIT_SCRIPT], cwd=tmp_path, capture_output=True,
                          text=True, timeout=30, input=json.dumps({"path": path, "old": old, "new": new}))
    return done.returncode, done.stdout.strip()


def test_the_edit_script_replaces_exactly_one_occurrence_and_says_why_it_refuses(tmp_path):
    (tmp_path / "m.py").write_text("a = 1\nb = 1\n")
    assert _edit(tmp_path, "m.py", "a = 1", "a = 2") == (0, "edited m.py")
    assert (tmp_path / "m.py").read_text() == "a = 2\nb = 1\n"
    code, out = _edit(tmp_path, "m.py", "= ", "")
    assert code == 1 and "occurs 2 times" in out
    code, out = _edit(tmp_path, "gone.py", "x", "y")
    assert code == 1 and out.startswith("error: cannot read gone.py")


class _FakeSandbox:
    """Records execs; answers like a sandbox that ran them with exit status `status`."""

    def __init__(self, stdout=b"", status=0):
        self.calls, self.stdout, self.status = [], stdout, status
        self.tool_timeout_s, self.sandbox_id = 5.0, "s"

    async def exec(self, argv, stdin=b"", timeout_s=None, cwd=""):
        from rlfleet.api.sandbox.v1 import sandbox_pb2

        self.calls.append((tuple(argv), stdin))
        return sandbox_pb2.ExecResult(exit_code=self.status, stdout=self.stdout)


async def test_every_repo_tool_call_is_one_process_in_the_sandbox():
    env = RepoEnvironment()
    box = _FakeSandbox(stdout=b"./b.py\n./a.py\n")
    listed = await env.run_tool(box, ToolCall("list_files", ""))
    assert listed.observation == "a.py\nb.py" and box.calls[-1][0][0] == "find"
    await env.run_tool(box, ToolCall("read_file", "a.py"))
    assert box.calls[-1][0] == ("cat", "--", "a.py")
    await env.run_tool(box, ToolCall("run", "python3 test_a.py"))
    assert box.calls[-1][0] == ("sh", "-c", "python3 test_a.py")
    await env.run_tool(box, ToolCall("edit_file", "a.py\n    return a - b\n---\n    return a + b"))
    assert json.loads(box.calls[-1][1]) == {"path": "a.py", "old": "    return a - b",
                                            "new": "    return a + b"}
    assert len(box.calls) == 4
    bad = await env.run_tool(box, ToolCall("edit_file", "a.py\nno separator"))
    assert not bad.ok and "---" in bad.observation and len(box.calls) == 4


async def test_the_run_tool_caps_its_output():
    env = RepoEnvironment()
    result = await env.run_tool(_FakeSandbox(stdout=b"x" * 5000), ToolCall("run", "yes"))
    assert len(result.observation) < 700 and "more characters" in result.observation


def test_the_suite_is_a_built_in_one():
    assert generate_tasks("repo", "train", 2, difficulty=3)[0].suite == "repo"
