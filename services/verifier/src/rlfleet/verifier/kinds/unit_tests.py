"""The ``unit_tests`` kind: run the hidden test script against the candidate's files.

The kind never executes anything itself: a :class:`TestRunner` is injected. The verifier service
gives it one that runs in a fresh sandbox of its own (never the policy's); tests may give it
:func:`run_locally`.

Candidate code never runs in the process that decides the verdict, nor in the one that runs the
hidden tests. What the runner executes is the supervisor (``supervisor.py``, ``python3 -I -c``):
it gets the hidden script, a per-run random nonce and the time budget on stdin (the tests never
touch the sandbox's disk), makes itself non-dumpable, and runs the script with the candidate's
modules replaced by proxies whose every call runs in a fresh worker process that sends back only
data. Its report is one line ``RLFLEET-HARNESS-REPORT <nonce> <json>``; this kind decides the
verdict from that report alone, so candidate prints, exit codes, files, ``atexit`` handlers and
signals cannot change it. A run without exactly one report carrying this run's nonce fails.

Only the files the task declares (``solution_files``) are handed over, so the policy cannot plant
a ``conftest.py``, a ``sitecustomize.py`` or its own copy of the test file next to the tests.

Test-script contract: one ``FAIL <name>: <why>`` line per failing test (``PASS <name>`` for the
others), then ``RESULT passed=<p> failed=<f>``, and exit status 0 only when all passed (pytest's
``FAILED file::name - why`` lines and ``N passed`` summary are understood too). Candidate modules
are used through their module-level functions, called with plain data (None, bool, int, float,
complex, str, bytes, list, tuple, dict, set, frozenset) and returning plain data.

Failure reasons are codes with fixed messages: ``WRONG_ANSWER``, ``EXCEPTION`` (the candidate
raised, or its process died), ``TIMEOUT``, ``REWARD_HACKING`` (printed harness lines, exited 0
before returning, returned a non-data object, wrote outside the reply protocol, forged a report),
``SAFETY_VIOLATION`` (left processes running), ``TEST_FAILED`` (the script failed otherwise).
Tests are named by their index; the only candidate text kept (an exception's type and message) is
bounded, and any stretch of it that also occurs in the hidden tests is masked.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfleet.verifier.kinds.base import ScoringConfig, VerifierKind
from rlfleet.verifier.kinds.records import Episode, Reason, ReasonCode

SUPERVISOR_SOURCE = (Path(__file__).parent / "supervisor.py").read_text(encoding="utf-8")
HARNESS_ARGV = ("python3", "-I", "-c", SUPERVISOR_SOURCE)
REPORT_TAG = "RLFLEET-HARNESS-REPORT"
GRACE_S = 5.0  # the sandbox's wall limit beyond the tests' budget, so the supervisor can still report
_FAIL_RE = re.compile(r"^FAIL (?P<name>\S+?):")
_PYTEST_FAILED_RE = re.compile(r"^FAILED \S+?::(?P<name>\S+)")
_RESULT_RE = re.compile(r"^RESULT passed=(?P<passed>\d+) failed=(?P<failed>\d+)\s*$")
_PYTEST_SUMMARY_RE = re.compile(r"^=+ (?P<passed>\d+) passed(?P<rest>.*?)=+$")
_PRINTABLE_RE = re.compile(r"[^ -~]")
MAX_REASONS = 20
MAX_MESSAGE = 160
_WINDOW = 8  # candidate text sharing this many characters in a row with the hidden tests is masked


@dataclass(frozen=True)
class TestRunRequest:
    """Run ``argv`` in a fresh sandbox holding only ``files``, ``stdin`` on its standard input."""

    __test__ = False  # not a pytest test class, whatever its name says

    argv: tuple[str, ...]
    stdin: bytes
    files: Mapping[str, bytes | str]  # candidate files, by path relative to the working directory
    timeout_s: float  # the run's wall limit (the tests' budget plus GRACE_S)


@dataclass(frozen=True)
class TestRunResult:
    __test__ = False

    exit_code: int
    output: str  # standard output (the supervisor's report is the one line of it that counts)
    timed_out: bool = False
    violations: tuple[str, ...] = field(default_factory=tuple)  # sandbox violation kinds of the run


TestRunner = Callable[[TestRunRequest], TestRunResult]


def harness_request(spec: Mapping[str, Any], files: Mapping[str, bytes | str], nonce: str) -> TestRunRequest:
    timeout_s = float(spec.get("timeout_s", 10.0))
    modules = [name.removesuffix(".py") for name in files if name.endswith(".py") and "/" not in name]
    job = {"nonce": nonce, "tests": spec["tests"], "test_file": spec.get("test_file", "test_hidden.py"),
           "timeout_s": timeout_s, "modules": modules}
    return TestRunRequest(argv=HARNESS_ARGV, stdin=json.dumps(job).encode(), files=dict(files),
                          timeout_s=timeout_s + GRACE_S)


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
        nonce = secrets.token_hex(16)
        request = harness_request(spec, {name: episode.files[name] for name in wanted}, nonce)
        result = self.runner(request)
        reasons = judge(result, nonce, spec["tests"], float(spec.get("timeout_s", 10.0)))
        unsafe = sorted({kind for kind in result.violations if kind in self.config.safety_violation_kinds})
        return reasons + [Reason(ReasonCode.SAFETY_VIOLATION,
                                 f"the hidden-test run's sandbox saw a {kind} violation",
                                 {"failure": "SANDBOX_VIOLATION", "kind": kind}) for kind in unsafe]


def judge(result: TestRunResult, nonce: str, tests: str, timeout_s: float) -> list[Reason]:
    """The failures of a supervised run, decided from its nonce-tagged report alone."""
    report, forged = read_report(result.output, nonce)
    if forged:
        return [Reason(ReasonCode.REWARD_HACKING, "the run's output carried a forged harness report",
                       {"failure": "FORGED_REPORT"})]
    if report is None:
        if result.timed_out:
            return [Reason(ReasonCode.TIMEOUT, f"the hidden tests ran past {timeout_s:g}s",
                           {"failure": "TIMEOUT"})]
        return [Reason(ReasonCode.TEST_FAILED, "the test harness ended without its report",
                       {"failure": "NO_REPORT", "exit_code": str(result.exit_code)})]
    if not report.get("protected"):
        return [Reason(ReasonCode.VERIFIER_ERROR, "the test harness could not protect itself (prctl failed)",
                       {"failure": "UNPROTECTED"})]
    return reasons_from_report(report, tests, timeout_s)


def read_report(output: str, nonce: str) -> tuple[dict | None, bool]:
    """(this run's report, whether any other report-looking line was there: a forgery)."""
    mine, others = [], 0
    for line in output.splitlines():
        if not line.startswith(REPORT_TAG):
            continue
        parts = line.split(" ", 2)
        if len(parts) == 3 and secrets.compare_digest(parts[1], nonce):
            mine.append(parts[2])
        else:
            others += 1
    if others or len(mine) > 1:
        return None, True
    if not mine:
        return None, False
    try:
        report = json.loads(mine[0])
    except ValueError:
        return None, False
    return (report, False) if isinstance(report, dict) else (None, False)


_CODE_OF_OUTCOME = {
    "REWARD_HACKING": ReasonCode.REWARD_HACKING,
    "SAFETY_VIOLATION": ReasonCode.SAFETY_VIOLATION,
    "TIMEOUT": ReasonCode.TIMEOUT,
    "EXCEPTION": ReasonCode.EXCEPTION,
    "CRASHED": ReasonCode.EXCEPTION,
}
_MESSAGE_OF_CODE = {
    ReasonCode.REWARD_HACKING: "the candidate tried to pass without a right answer",
    ReasonCode.SAFETY_VIOLATION: "the candidate left processes running",
    ReasonCode.TIMEOUT: "the candidate ran out of time",
    ReasonCode.EXCEPTION: "the candidate raised or its process died",
    ReasonCode.WRONG_ANSWER: "wrong answer",
}
_SEVERITY = ["REWARD_HACKING", "SAFETY_VIOLATION", "TIMEOUT", "EXCEPTION", "CRASHED"]


def reasons_from_report(report: Mapping[str, Any], tests: str, timeout_s: float) -> list[Reason]:
    lines = [line for line in report.get("lines", ()) if isinstance(line, dict)]
    texts = [str(line.get("text", "")) for line in lines]
    failures = list(report.get("failures", ()))
    reasons: list[Reason] = []
    index = 0
    for line in lines:
        text = str(line.get("text", ""))
        if _RESULT_RE.match(text) or _PYTEST_SUMMARY_RE.match(text.strip()):
            continue
        is_fail = bool(_FAIL_RE.match(text) or _PYTEST_FAILED_RE.match(text))
        is_test = is_fail or text.startswith("PASS ")
        if is_fail:
            outcomes = [o for o in _SEVERITY if o in line.get("outcomes", ())]
            code = _CODE_OF_OUTCOME[outcomes[0]] if outcomes else ReasonCode.WRONG_ANSWER
            details = {"test": str(index), "failure": outcomes[0] if outcomes else "WRONG_ANSWER"}
            if code == ReasonCode.EXCEPTION:
                details.update(exception_details(failures, outcomes[0], tests))
            reasons.append(Reason(code, f"test {index}: {_MESSAGE_OF_CODE[code]}", details))
        index += is_test
    totals = report.get("outcomes") or {}  # outcome -> calls, over the whole run
    for outcome in ("REWARD_HACKING", "SAFETY_VIOLATION"):  # fail the run even if no test reported it
        code = _CODE_OF_OUTCOME[outcome]
        if totals.get(outcome) and code not in {r.code for r in reasons}:
            reasons.append(Reason(code, _MESSAGE_OF_CODE[code],
                                  {"failure": outcome, "calls": str(totals[outcome])}))
    if totals.get("TIMEOUT") and ReasonCode.TIMEOUT not in {r.code for r in reasons}:
        reasons.append(Reason(ReasonCode.TIMEOUT, f"the hidden tests ran past {timeout_s:g}s",
                              {"failure": "TIMEOUT"}))
    if len(reasons) > MAX_REASONS:
        more = len(reasons) - MAX_REASONS
        reasons = [*reasons[:MAX_REASONS], Reason(reasons[MAX_REASONS].code, f"and {more} more failing tests",
                                                  {"more": str(more)})]
    if reasons:
        return reasons
    exit_code = report.get("exit_code", 1)
    if report.get("error"):
        outcome = str(report.get("error_code") or "")
        code = _CODE_OF_OUTCOME.get(outcome, ReasonCode.TEST_FAILED)
        message = _MESSAGE_OF_CODE[code] if outcome in _CODE_OF_OUTCOME else "the test script raised"
        return [Reason(code, message, {"failure": outcome or "SCRIPT_ERROR",
                                       "exception": _clean(str(report["error"]), tests)})]
    if exit_code != 0:
        return [Reason(ReasonCode.TEST_FAILED, f"the test script exited with status {int(exit_code)}",
                       {"failure": "EXIT_STATUS"})]
    if _passed_count(texts) < 1:
        return [Reason(ReasonCode.TEST_FAILED, "the test script reported no passed tests",
                       {"failure": "NO_PASS"})]
    return []


def exception_details(failures: list, outcome: str, tests: str) -> dict[str, str]:
    """The next unreported failure of this kind: the exception's name or how the process died."""
    for failure in failures:
        if isinstance(failure, dict) and failure.get("code") == outcome and not failure.get("_used"):
            failure["_used"] = True
            return {"exception": _clean(str(failure.get("detail", "")), tests)}
    return {}


def _clean(text: str, tests: str) -> str:
    """Bounded, printable, and with every stretch that also occurs in the hidden tests masked."""
    text = _PRINTABLE_RE.sub("?", text)[:MAX_MESSAGE]
    if len(text) < _WINDOW:
        return text if text not in tests or not text.strip() else "[masked]"
    masked = [False] * len(text)
    for start in range(len(text) - _WINDOW + 1):
        if text[start:start + _WINDOW] in tests:
            masked[start:start + _WINDOW] = [True] * _WINDOW
    return "".join("*" if m else c for c, m in zip(text, masked, strict=True))


def _passed_count(lines: list[str]) -> int:
    """Passed tests by the last summary line, 0 without one or when it reports any failure."""
    for line in reversed(lines):
        if match := _RESULT_RE.match(line):
            return int(match["passed"]) if int(match["failed"]) == 0 else 0
        if match := _PYTEST_SUMMARY_RE.match(line.strip()):
            return 0 if re.search(r"failed|error", match["rest"]) else int(match["passed"])
    return 0


def run_locally(request: TestRunRequest, workdir: str | os.PathLike | None = None) -> TestRunResult:
    """Runs a harness request in a temporary folder with this interpreter: the runner's shape, WITHOUT
    a sandbox's isolation (no uid, memory or network limits). For tests and trusted audits only."""
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        for name, content in request.files.items():
            path = Path(tmp) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content.encode() if isinstance(content, str) else bytes(content))
        argv = [sys.executable, *request.argv[1:]]
        try:
            done = subprocess.run(argv, input=request.stdin, cwd=tmp, capture_output=True,
                                  timeout=request.timeout_s, start_new_session=True)
        except subprocess.TimeoutExpired as exc:
            return TestRunResult(-9, (exc.stdout or b"").decode("utf-8", "replace"), timed_out=True)
        return TestRunResult(done.returncode, done.stdout.decode("utf-8", "replace"))
