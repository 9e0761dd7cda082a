import subprocess
import sys
from collections import Counter

import pytest

from rlfleet.envkit import repo_demos
from rlfleet.envkit.suites import repo

unit_tests = pytest.importorskip("rlfleet.verifier.kinds.unit_tests")


def _final_files(demo, task):
    """Replays a demo's edits on the task's workspace (the edit rule: exactly one occurrence)."""
    files = dict(task.workspace)
    for message in demo["messages"]:
        if message["role"] == "assistant" and message["content"].startswith("<edit_file>"):
            body = message["content"].removeprefix("<edit_file>").removesuffix("</edit_file>")
            path, _, rest = body.partition("\n")
            old, _, new = rest.partition(repo.EDIT_SEPARATOR)
            if files[path].count(old) == 1:
                files[path] = files[path].replace(old, new, 1)
    return files


def test_demos_are_deterministic_and_flawed_at_the_asked_share():
    demos = repo_demos.generate_demos(1000, seed=2, imperfection=0.5)
    assert demos == repo_demos.generate_demos(1000, seed=2, imperfection=0.5)
    flaws = Counter(d["flaw"] for d in demos)
    assert 0.45 < flaws["none"] / 1000 < 0.55 and set(flaws) == {"none", *repo_demos.FLAWS}
    train = {t.task_id for t in repo.generate_tasks("train", 1000, seed=2)}
    assert {d["task_id"] for d in demos} == train


@pytest.mark.parametrize("level", repo.LEVELS)
def test_ideal_demos_pass_the_hidden_tests_and_flawed_ones_that_never_edit_fail_them(level):
    tasks = {t.task_id: t for t in repo.generate_tasks("train", 60, seed=4, difficulty=level)}
    demos = repo_demos.generate_demos(60, seed=4, imperfection=0.6, difficulty=level)
    checked = Counter()
    for demo in demos:
        if demo["flaw"] not in ("none", "no_edit", "wrong_edit") or checked[demo["flaw"]] >= 3:
            continue
        task = tasks[demo["task_id"]]
        spec = task.verifier.model_dump()
        files = _final_files(demo, task)
        result = unit_tests.run_locally(unit_tests.harness_request(
            spec, {p: files[p] for p in task.verifier.solution_files}, "n0nce"))
        passed = unit_tests.judge(result, "n0nce", spec["tests"], 10.0) == []
        assert passed == (demo["flaw"] == "none"), (demo["flaw"], demo["messages"][-6:])
        checked[demo["flaw"]] += 1
    assert checked["none"] >= 1


def test_the_run_observation_in_a_demo_is_what_the_visible_test_prints(tmp_path):
    for level in repo.LEVELS:
        task = repo.generate_tasks("train", 1, seed=7, difficulty=level)[0]
        instance = repo.instance_of(task)
        for files in (dict(task.workspace), repo.fixed_workspace(task)):
            for path, text in files.items():
                (tmp_path / path).write_text(text)
            done = subprocess.run([sys.executable, instance.test_file], cwd=tmp_path,
                                  capture_output=True, text=True, timeout=30)
            visible = instance.visible_output(files[instance.target_file])
            assert visible == (done.stdout.rstrip("\n"), done.returncode)


def test_a_wrong_rewrite_is_neither_the_fix_nor_the_bug_and_compiles():
    for task in repo.generate_tasks("train", 100, seed=8):
        old, right = repo.instance_of(task).fix()
        wrong = repo_demos.wrong_rewrite(right, old)
        assert wrong not in (right, old)
        assert repo_demos.compiles(wrong) and repo_demos.compiles(right)
