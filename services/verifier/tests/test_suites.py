"""The suite catalog: loads every suite under a directory, rejects bad files whole with their line,
reloads on a miss."""

from __future__ import annotations

import json
import os

import pytest

from rlfleet.verifier.suites import SuiteCatalog, TaskNotFound

KINDS = ("exact", "numeric")


def line(task_id: str, suite: str = "calc", kind: str = "numeric", **extra) -> str:
    verifier = {"kind": kind, "answer": "3"} if kind != "unit_tests" else {"kind": kind, "tests": "print(1)"}
    return json.dumps({"task_id": task_id, "suite": suite, "split": "train", "prompt": "1+2?",
                       "verifier": verifier, **extra})


def write(path, *lines: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


async def test_tasks_of_every_suite_file_are_found_with_their_hidden_fields(tmp_path):
    write(tmp_path / "calc.jsonl", line("a"), "", line("b"))
    write(tmp_path / "nested" / "trivia.jsonl", line("a", suite="trivia", kind="exact"))
    catalog = SuiteCatalog(tmp_path, KINDS)
    assert (await catalog.task("calc", "b"))["verifier"] == {"kind": "numeric", "answer": "3",
                                                             "tolerance": 0.0}
    assert (await catalog.task("trivia", "a"))["suite"] == "trivia"
    assert (await catalog.task("", "b"))["task_id"] == "b"  # unique without its suite
    with pytest.raises(TaskNotFound, match="several suites"):
        await catalog.task("", "a")
    with pytest.raises(TaskNotFound, match="no suite 'chess'"):
        await catalog.task("chess", "a")


async def test_a_file_with_a_bad_or_unconfigured_kind_is_rejected_with_its_line_and_the_rest_still_serve(tmp_path):  # noqa: E501
    write(tmp_path / "good.jsonl", line("g"))
    write(tmp_path / "regex.jsonl", line("r1", suite="regex"), line("r2", suite="regex", kind="regex"))
    write(tmp_path / "code.jsonl", line("c1", suite="code", kind="unit_tests"))
    catalog = SuiteCatalog(tmp_path, KINDS)
    assert await catalog.task("calc", "g")
    with pytest.raises(TaskNotFound) as err:
        await catalog.task("regex", "r1")
    assert "regex.jsonl:2: verifier.kind: unknown verifier kind 'regex'" in str(err.value)
    assert "code.jsonl:1: verifier.kind: no verifier kind 'unit_tests' is configured" in str(err.value)


async def test_a_suite_written_later_is_found_and_a_deleted_one_forgotten(tmp_path):
    catalog = SuiteCatalog(tmp_path / "suites", KINDS)  # not even created yet
    assert not catalog.refresh()
    write(tmp_path / "suites" / "calc.jsonl", line("a"))
    assert await catalog.task("calc", "a")
    write(tmp_path / "suites" / "calc.jsonl", line("a"), line("b"))
    os.utime(tmp_path / "suites" / "calc.jsonl", ns=(1, 1))  # a new stamp even within the clock's resolution
    assert await catalog.task("calc", "b")
    (tmp_path / "suites" / "calc.jsonl").unlink()
    with pytest.raises(TaskNotFound):
        await catalog.task("calc", "zzz")
    assert not catalog.tasks


async def test_a_task_defined_twice_rejects_the_later_file_until_the_clash_is_gone(tmp_path):
    write(tmp_path / "a.jsonl", line("t"))
    write(tmp_path / "b.jsonl", line("t"), line("u"))
    catalog = SuiteCatalog(tmp_path, KINDS)
    catalog.refresh()
    assert "already defined in" in catalog.rejected[str(tmp_path / "b.jsonl")]
    with pytest.raises(TaskNotFound):
        await catalog.task("calc", "u")
    (tmp_path / "a.jsonl").unlink()
    assert await catalog.task("calc", "u") and not catalog.rejected
