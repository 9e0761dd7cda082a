"""Violations are derived from facts; heuristics from stderr are marked inferred."""

from __future__ import annotations

import dataclasses

from rlfleet.sandbox import Limits, ViolationKind
from rlfleet.sandbox.violations import ExecFacts, derive

V = ViolationKind
CLEAN = ExecFacts(
    limits=Limits(cpu_seconds=2, max_output_bytes=10),
    timeout_s=5,
    exit_code=0,
    signal=None,
    timed_out=False,
    cpu_s=0.1,
    stdout_truncated=False,
    stderr_truncated=False,
    stdout_bytes=0,
    stderr_bytes=0,
    stderr_sample=b"",
    oom_kills=0,
    pids_max_hits=0,
    network=False,
)


def kinds(**changes) -> dict[ViolationKind, bool]:
    return {v.kind: v.inferred for v in derive(dataclasses.replace(CLEAN, **changes))}


def test_a_clean_run_has_no_violations():
    assert derive(CLEAN) == ()


def test_observed_facts_are_not_inferred():
    assert kinds(timed_out=True, signal=9, exit_code=137) == {V.TIMEOUT: False}
    assert kinds(signal=24, exit_code=152, cpu_s=2.0) == {V.CPU: False}
    assert kinds(signal=9, exit_code=137, cpu_s=3.0) == {V.CPU: False}  # the hard limit
    assert kinds(oom_kills=1, signal=9, exit_code=137) == {V.MEMORY: False}
    assert kinds(pids_max_hits=3) == {V.PROCESSES: False}
    assert kinds(signal=25, exit_code=153) == {V.FILE_SIZE: False}
    assert kinds(stdout_truncated=True, stdout_bytes=100) == {V.OUTPUT: False}


def test_a_limit_kill_is_a_violation_from_the_signal_whatever_rusage_reads():
    # Under load rusage read 9.89 s for a 10 s SIGXCPU kill: the signal decides, not a threshold.
    ten = Limits(cpu_seconds=10, max_output_bytes=10)
    assert kinds(limits=ten, signal=24, exit_code=152, cpu_s=9.89) == {V.CPU: False}
    # faked: counts against it
    assert kinds(limits=ten, signal=24, exit_code=152, cpu_s=0.01) == {V.CPU: False}
    # the hard limit, undercounted
    assert kinds(limits=ten, signal=9, exit_code=137, cpu_s=10.9) == {V.CPU: False}
    assert kinds(limits=ten, signal=9, exit_code=137, cpu_s=10.0) == {V.CPU: False}  # past the soft limit
    # no limit of its own: someone else's kill
    assert kinds(limits=ten, signal=9, exit_code=137, cpu_s=0.2) == {}
    assert kinds(limits=ten, signal=9, exit_code=137, cpu_s=0.2, oom_kills=1) == {V.MEMORY: False}
    assert kinds(limits=ten, timed_out=True, signal=9, exit_code=137, cpu_s=0.2) == {V.TIMEOUT: False}
    assert "cgroup OOM" in derive(dataclasses.replace(CLEAN, signal=9, exit_code=137, oom_kills=1))[0].message


def test_a_tree_that_uses_more_cpu_in_total_than_the_limit_is_recorded():
    assert kinds(cpu_s=5.0) == {V.CPU: False}


def test_stderr_messages_give_inferred_violations():
    assert kinds(stderr_sample=b"Traceback...\nMemoryError\n") == {V.MEMORY: True}
    assert kinds(stderr_sample=b"bash: fork: retry: Resource temporarily unavailable") == {V.PROCESSES: True}
    assert kinds(stderr_sample=b"OSError: [Errno 27] File too large") == {V.FILE_SIZE: True}
    assert kinds(stderr_sample=b"touch: cannot touch '/usr/x': Read-only file system") == {V.FILESYSTEM: True}
    assert kinds(stderr_sample=b"OSError: [Errno 101] Network is unreachable") == {V.NETWORK: True}


def test_network_errors_are_not_violations_when_the_sandbox_has_network():
    assert kinds(stderr_sample=b"Network is unreachable", network=True) == {}


def test_an_observed_violation_wins_over_the_same_kind_inferred():
    assert kinds(oom_kills=1, stderr_sample=b"MemoryError") == {V.MEMORY: False}
