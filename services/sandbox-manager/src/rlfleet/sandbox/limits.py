"""Resource limits of a sandbox: the validated dataclass and its translation to rlimits.

Ranges are hard maxima of the platform, not defaults: a request outside them is rejected with the
field named, never clamped silently (a clamped limit would make a run's results mean something
other than what its config says).
"""

from __future__ import annotations

import math
import resource
from dataclasses import dataclass, fields, replace
from typing import Any

from rlfleet.sandbox.errors import InvalidSandboxRequest

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# field -> (minimum, maximum), both inclusive.
LIMIT_RANGES: dict[str, tuple[float, float]] = {
    # RLIMIT_CPU has one-second granularity, so sub-second CPU limits cannot be honoured.
    "cpu_seconds": (1, 3600),
    # Below ~32 MiB a Python interpreter cannot start, which would look like a sandbox bug.
    "memory_bytes": (32 * MiB, 64 * GiB),
    "wall_seconds": (0.1, 3600),
    # Counts processes *and threads* of the sandbox's uid (RLIMIT_NPROC semantics).
    "max_processes": (1, 4096),
    "max_file_bytes": (1, 16 * GiB),
    # Per stream (stdout and stderr each); 0 means "discard everything".
    "max_output_bytes": (0, 64 * MiB),
}

_INTEGER_FIELDS = {"memory_bytes", "max_processes", "max_file_bytes", "max_output_bytes"}


@dataclass(frozen=True, slots=True)
class Limits:
    """What a sandbox's execs may use. Validated on construction; see LIMIT_RANGES.

    cpu_seconds: CPU time per process (RLIMIT_CPU); a tree's total is measured and reported.
    memory_bytes: resident memory of the sandbox (memory cgroup), or address space per process.
    wall_seconds: wall-clock time of one exec (the exec's `timeout` may override it).
    max_processes: processes and threads the program may have at once (its init not counted).
    max_file_bytes: size of any one file it writes (RLIMIT_FSIZE); also caps files put in by the host.
    max_output_bytes: stdout and stderr kept per exec, each; the rest is read and dropped.
    """

    cpu_seconds: float = 10.0
    memory_bytes: int = 512 * MiB
    wall_seconds: float = 30.0
    max_processes: int = 64
    max_file_bytes: int = 64 * MiB
    max_output_bytes: int = 1 * MiB

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_range(f.name, getattr(self, f.name))

    def replace(self, **changes: Any) -> Limits:
        """A copy with some fields changed (validated like a new instance)."""
        unknown = set(changes) - set(LIMIT_RANGES)
        if unknown:
            raise InvalidSandboxRequest(f"unknown limit(s): {sorted(unknown)}", field="limits")
        return replace(self, **changes)

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> Limits:
        """Build from e.g. a request's JSON/proto fields; unknown keys are errors, not ignored."""
        return cls().replace(**values)


def _check_range(name: str, value: Any) -> None:
    lo, hi = LIMIT_RANGES[name]
    field = f"limits.{name}"
    # bool is an int subclass; `memory_bytes=True` is a bug in the caller, not one byte.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidSandboxRequest(f"{field} must be a number, got {type(value).__name__}", field=field)
    if name in _INTEGER_FIELDS and not isinstance(value, int):
        raise InvalidSandboxRequest(f"{field} must be an integer, got {value!r}", field=field)
    if math.isnan(value) or not lo <= value <= hi:
        raise InvalidSandboxRequest(
            f"{field}={value!r} is out of range [{_fmt(name, lo)}, {_fmt(name, hi)}]",
            field=field,
            value=value,
            minimum=lo,
            maximum=hi,
        )


def _fmt(name: str, v: float) -> str:
    if name.endswith("_bytes") and v >= MiB:
        return f"{v / MiB:g} MiB"
    return f"{v:g}"


def rlimits(
    limits: Limits, *, limit_address_space: bool, extra_tasks: int = 0
) -> list[tuple[int, tuple[int, int]]]:
    """The rlimits (resource, (soft, hard)) that apply `limits` to a process and what it execs.

    `extra_tasks`: tasks of the sandbox's uid that are not the program's (its init), added to
    RLIMIT_NPROC so that `max_processes` is what the program itself may have.

    CPU: soft limit sends SIGXCPU (so the violation is visible as that signal), the hard limit one
    second later SIGKILLs a process that ignores it. Memory: RLIMIT_AS only when no memory cgroup
    enforces it (it counts reserved, not used, memory, so it is a cruder bound). Core dumps are off
    (they would write into the workspace and leak memory contents of earlier runs of the binary).
    """
    cpu = math.ceil(limits.cpu_seconds)
    out = [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_FSIZE, (limits.max_file_bytes, limits.max_file_bytes)),
        (resource.RLIMIT_NPROC, (limits.max_processes + extra_tasks,) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
        (resource.RLIMIT_NOFILE, (1024, 1024)),
    ]
    if limit_address_space:
        out.append((resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes)))
    return out
