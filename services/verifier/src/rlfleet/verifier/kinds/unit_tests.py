"""The ``unit_tests`` kind: run the hidden test script against the candidate's files.

The kind never executes anything itself: a :class:`TestRunner` is injected. The verifier service
gives it one that runs the script in a fresh sandbox of its own (never the policy's, so nothing the
policy left behind can touch the tests); tests give it a fake.

Only the files the task declares (``solution_files``) are handed over, so the policy cannot plant
a ``conftest.py``, a ``sitecustomize.py`` or its own copy of the test file next to the tests.

Test-script contract (what the built-in code suite's harness prints): one ``FAIL <name>: <why>``
line per failing test (``PASS <name>`` for the others), then ``RESULT passed=<p> failed=<f>``, and
exit status 0 only when all passed. pytest output is understood too (``FAILED file::name - why``
lines and the ``N passed`` summary). A pass needs exit status 0, no failing test and a summary
that reports at least one passed test: a solution that exits the process early passes nothing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rlfleet.verifier.kinds.base import ScoringConfig, VerifierKind
from rlfleet.verifier.kinds.records import Episode, Reason, ReasonCode

_FAIL_RE = re.compile(r"^FAIL (?P<name>\S+?): ?(?P<why>.*)$")
_PYTEST_FAILED_RE = re.compile(r"^FAILED \S+?::(?P<name>\S+)(?: - (?P<why>.*))?$")
_RESULT_RE = re.compile(r"^RESULT passed=(?P<passed>\d+) failed=(?P<failed>\d+)\s*$")
_PYTEST_SUMMARY_RE = re.compile(r"^=+ (?P<passed>\d+) passed(?P<rest>.*?)=+$")
MAX_REASONS = 20
_TAIL = 400


@dataclass(frozen=True)
class TestRunRequest:
    __test__ = False  # not a pytest test class, whatever its name says

    tests: str  # the hidden test script
    test_file: str  # the name it is written under, next to the candidate files
    files: Mapping[str, bytes | str]  # candidate files, by path relative to the working directory
    timeout_s: float


@dataclass(frozen=True)
class TestRunResult:
    __test__ = False

    exit_code: int
    output: str  # stdout and stderr together
    timed_out: bool = False


TestRunner = Callable[[TestRunRequest], TestRunResult]


class UnitTestsKind(VerifierKind):
    name = "unit_tests"

    def __init__(self, runner: TestRunner, config: ScoringConfig | None = None) -> None:
        super().__init__(config)
        self.runner = runner

    def check(self, spec: Mapping[str, Any], episode: Episode, answer: str | None) -> list[Reason]:
        wanted = list(spec.get("solution_files", ("solution.py",)))
        missing = [name for name in wanted if name not in episode.files]
        if missing:
            return [
                Reason(
                    ReasonCode.NO_ANSWER,
                    f"the candidate did not write {', '.join(missing)}",
                    {"missing": ",".join(missing)},
                )
            ]
        request = TestRunRequest(
            tests=spec["tests"],
            test_file=spec.get("test_file", "test_hidden.py"),
            files={name: episode.files[name] for name in wanted},
            timeout_s=float(spec.get("timeout_s", 10.0)),
        )
        result = self.runner(request)
        if result.timed_out:
            return [
                Reason(
                    ReasonCode.TIMEOUT,
                    f"the hidden tests ran past {request.timeout_s:g}s",
                    {"output": result.output[-_TAIL:]},
                )
            ]
        return failing_tests(result)


def failing_tests(result: TestRunResult) -> list[Reason]:
    """TEST_FAILED reasons (one per failing test, by name) from a run's exit status and output."""
    lines = result.output.splitlines()
    failures = []
    for line in lines:
        match = _FAIL_RE.match(line) or _PYTEST_FAILED_RE.match(line)
        if match:
            failures.append(
                Reason(
                    ReasonCode.TEST_FAILED,
                    f"{match['name']} failed",
                    {"test": match["name"], "why": (match["why"] or "")[:_TAIL]},
                )
            )
    if len(failures) > MAX_REASONS:
        more = len(failures) - MAX_REASONS
        failures = [
            *failures[:MAX_REASONS],
            Reason(ReasonCode.TEST_FAILED, f"and {more} more failing tests", {"more": str(more)}),
        ]
    tail = {"exit_code": str(result.exit_code), "output": result.output[-_TAIL:]}
    if failures:
        return failures
    if result.exit_code != 0:
        return [
            Reason(ReasonCode.TEST_FAILED, f"the test script exited with status {result.exit_code}", tail)
        ]
    if _passed_count(lines) < 1:
        return [
            Reason(
                ReasonCode.TEST_FAILED,
                "the test script reported no passed tests (did the solution exit early?)",
                tail,
            )
        ]
    return []


def _passed_count(lines: list[str]) -> int:
    """Passed tests by the last summary line, 0 without one or when it reports any failure."""
    for line in reversed(lines):
        if match := _RESULT_RE.match(line):
            return int(match["passed"]) if int(match["failed"]) == 0 else 0
        if match := _PYTEST_SUMMARY_RE.match(line.strip()):
            return 0 if re.search(r"failed|error", match["rest"]) else int(match["passed"])
    return 0
