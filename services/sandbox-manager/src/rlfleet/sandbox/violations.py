"""Turn what is known about a finished exec into violation records.

Observed facts (`inferred=False`): the driver's own wall-clock kill, output it cut, a signal the kernel
sends for a limit (SIGXCPU, SIGXFSZ, and a SIGKILL the driver did not send) — recorded from the signal
alone: it is read back from a 128+N exit status a program could also produce, which can only count against
that program — and cgroup counters (OOM kills, pids.max hits), and a workspace tmpfs left with no space or
inodes. Heuristics (`inferred=True`): recognised error messages in the program's stderr. A program
controls its stderr, so heuristics can be faked or hidden; they exist because a limit that makes a call
fail (ENOMEM, EAGAIN, EROFS, ENETUNREACH) leaves no other trace outside the sandbox.
"""

from __future__ import annotations

import math
import re
import resource
import signal as _signal
from dataclasses import dataclass

from rlfleet.sandbox.cgroups import ExecUsage
from rlfleet.sandbox.driver import ExecResult, Violation, ViolationKind
from rlfleet.sandbox.limits import Limits
from rlfleet.sandbox.process import ProcessOutcome
from rlfleet.sandbox.workspace import WorkspaceQuota

K = ViolationKind

# (kind, pattern, what it means). Matched against the head and tail of stderr.
_STDERR_HINTS: list[tuple[ViolationKind, re.Pattern[bytes], str]] = [
    (
        K.MEMORY,
        re.compile(rb"MemoryError|Cannot allocate memory|std::bad_alloc|[Oo]ut of memory"),
        "allocation failed",
    ),
    (
        K.PROCESSES,
        re.compile(
            rb"fork: (retry: )?Resource temporarily unavailable|[Cc]an(no|')t fork|"
            rb"BlockingIOError: \[Errno 11\]"
        ),
        "process creation failed (EAGAIN)",
    ),
    (K.FILE_SIZE, re.compile(rb"File too large"), "a write hit the file size limit (EFBIG)"),
    (
        K.FILESYSTEM,
        re.compile(rb"Read-only file system"),
        "a write outside the workspace was refused (EROFS)",
    ),
    (K.FILESYSTEM, re.compile(rb"No space left on device"),
     "a size-limited filesystem (/tmp, /dev/shm or the workspace) is full"),
    (
        K.NETWORK,
        re.compile(rb"Network is unreachable|Temporary failure in name resolution|Name or service not known"),
        "network access failed; the sandbox has no network",
    ),
]


@dataclass(frozen=True, slots=True)
class ExecFacts:
    limits: Limits
    timeout_s: float
    exit_code: int
    signal: int | None
    timed_out: bool
    cpu_s: float
    stdout_truncated: bool
    stderr_truncated: bool
    stdout_bytes: int
    stderr_bytes: int
    stderr_sample: bytes  # head + tail of stderr
    oom_kills: int  # counted by the exec's memory cgroup (0 without cgroups)
    pids_max_hits: int  # forks refused at pids.max during the exec (0 without cgroups)
    network: bool
    workspace_bytes_full: bool = False  # the workspace tmpfs had no space left when the exec ended
    workspace_inodes_full: bool = False
    workspace_quota: WorkspaceQuota | None = None


def derive(f: ExecFacts) -> tuple[Violation, ...]:
    found: list[Violation] = []
    seen: set[ViolationKind] = set()

    def add(kind: ViolationKind, message: str, inferred: bool = False) -> None:
        if kind not in seen:
            seen.add(kind)
            found.append(Violation(kind, message, inferred))

    if f.timed_out:
        add(K.TIMEOUT, f"killed at the {f.timeout_s:g}s wall-clock limit")
    cpu_limit = math.ceil(f.limits.cpu_seconds)
    # A limit kill is recorded from the signal alone, never from a threshold on rusage: under load
    # the tree's rusage can read below the limit the kernel enforced (9.89 s for a 10 s SIGXCPU).
    # The signal comes back as a 128+N exit status a program could also produce itself; that can
    # only put a violation against it (fail closed), never take one away.
    if f.signal == _signal.SIGXCPU:
        add(K.CPU, f"SIGXCPU: a process reached its {cpu_limit}s CPU limit (tree total {f.cpu_s:.2f}s)")
    elif f.signal == _signal.SIGKILL and not f.timed_out and f.oom_kills == 0 and f.cpu_s >= cpu_limit:
        # Not the driver's deadline kill, and past the soft limit, where the kernel sent SIGXCPU: the
        # only SIGKILL the kernel sends for CPU is the hard limit a second later. (A SIGKILL with the
        # tree under the soft limit and no OOM count is no limit of this sandbox's: another process or
        # the host's OOM killer; callers treat it as an environment failure, not the program's.)
        add(K.CPU, f"SIGKILL at the hard CPU limit ({cpu_limit + 1}s; tree total {f.cpu_s:.2f}s)")
    elif f.cpu_s > f.limits.cpu_seconds + 0.1:
        # RLIMIT_CPU is per process: a tree can exceed the budget in total without any one process
        # being stopped. Recorded (it is a measured overrun), not enforced.
        add(
            K.CPU,
            f"the process tree used {f.cpu_s:.2f}s CPU in total, over the {f.limits.cpu_seconds:g}s limit",
        )
    if f.oom_kills > 0:
        add(
            K.MEMORY,
            f"the memory cgroup OOM-killed {f.oom_kills} process(es) "
            f"at the {f.limits.memory_bytes}-byte limit",
        )
    if f.pids_max_hits > 0:
        add(K.PROCESSES, f"{f.pids_max_hits} fork(s) refused at the {f.limits.max_processes}-process limit")
    if f.signal == _signal.SIGXFSZ:
        add(K.FILE_SIZE, f"SIGXFSZ: a write went past the {f.limits.max_file_bytes}-byte file size limit")
    if f.workspace_bytes_full and f.workspace_quota is not None:
        add(K.FILESYSTEM, f"the workspace is full: its {f.workspace_quota.bytes}-byte quota is used up")
    elif f.workspace_inodes_full and f.workspace_quota is not None:
        add(K.FILESYSTEM,
            f"the workspace is full: its {f.workspace_quota.inodes}-inode (file count) quota is used up")
    for stream, truncated, total in (
        ("stdout", f.stdout_truncated, f.stdout_bytes),
        ("stderr", f.stderr_truncated, f.stderr_bytes),
    ):
        if truncated:
            add(K.OUTPUT, f"{stream} was {total} bytes; kept the first {f.limits.max_output_bytes}")
    for kind, pattern, meaning in _STDERR_HINTS:
        if kind == K.NETWORK and f.network:
            continue
        match = pattern.search(f.stderr_sample)
        if match:
            add(
                kind,
                f"{meaning} (inferred from stderr: {match.group().decode(errors='replace')!r})",
                inferred=True,
            )
    return tuple(found)


def exec_result(
    outcome: ProcessOutcome,
    limits: Limits,
    timeout_s: float,
    usage: ExecUsage | None,
    pids_hits: int,
    network: bool,
    workspace: tuple[WorkspaceQuota, bool, bool] | None = None,
) -> ExecResult:
    """The result of a finished exec: what the program did, what it used, what it ran into."""
    exit_code = outcome.exit_code
    sig: int | None = None
    if outcome.timed_out:
        sig, exit_code = int(_signal.SIGKILL), 128 + _signal.SIGKILL
    elif 128 < exit_code <= 128 + _signal.SIGRTMAX:
        sig = exit_code - 128
    err = outcome.stderr
    sample = err.data[:8192] + (err.tail if err.truncated or len(err.data) > 8192 else b"")
    facts = ExecFacts(
        limits=limits,
        timeout_s=timeout_s,
        exit_code=exit_code,
        signal=sig,
        timed_out=outcome.timed_out,
        cpu_s=outcome.cpu_s,
        stdout_truncated=outcome.stdout.truncated,
        stderr_truncated=err.truncated,
        stdout_bytes=outcome.stdout.total_bytes,
        stderr_bytes=err.total_bytes,
        stderr_sample=sample,
        oom_kills=usage.oom_kills if usage else 0,
        pids_max_hits=pids_hits,
        network=network,
        workspace_quota=workspace[0] if workspace else None,
        workspace_bytes_full=workspace[1] if workspace else False,
        workspace_inodes_full=workspace[2] if workspace else False,
    )
    return ExecResult(
        exit_code=exit_code,
        signal=sig,
        stdout=outcome.stdout.data,
        stderr=err.data,
        stdout_truncated=outcome.stdout.truncated,
        stderr_truncated=err.truncated,
        duration_s=outcome.duration_s,
        cpu_s=outcome.cpu_s,
        max_rss_bytes=usage.peak_memory_bytes if usage else _clean_max_rss(outcome),
        violations=derive(facts),
    )


def _clean_max_rss(outcome: ProcessOutcome) -> int:
    """Peak RSS from rusage, or 0 when it cannot be told apart from the driver's own size: the
    kernel starts a forked child's maxrss at the parent's high-water mark, so any figure up to the
    driver's own peak may just be the driver."""
    driver_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return outcome.max_rss_bytes if outcome.max_rss_bytes > driver_peak else 0
