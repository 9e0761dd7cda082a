"""The isolation-driver contract: what the sandbox-manager service needs from any backend.

A sandbox is a workspace (files that persist across execs) plus the limits and policy every exec
in it runs under. Each exec is a fresh isolated process tree that sees only the workspace (at
/work, also its home and default cwd), a private /tmp, and a read-only system; nothing of the host
or of other sandboxes. Only the workspace persists between execs: /tmp is new each time, and no
process outlives the exec that started it (no background servers across tool calls).
Implementations: `rlfleet.sandbox.bubblewrap.BubblewrapDriver` (default).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from rlfleet.sandbox.errors import InvalidSandboxRequest
from rlfleet.sandbox.limits import Limits

# Hard caps on request sizes, independent of Limits (they protect the driver, not the sandbox).
MAX_TTL_SECONDS = 7 * 24 * 3600
MAX_ENV_BYTES = 256 * 1024
MAX_ARGV_BYTES = 1024 * 1024
MAX_STDIN_BYTES = 16 * 1024 * 1024
MAX_LABELS = 64


class ViolationKind(enum.StrEnum):
    TIMEOUT = "TIMEOUT"
    MEMORY = "MEMORY"
    CPU = "CPU"
    PROCESSES = "PROCESSES"
    OUTPUT = "OUTPUT"
    FILE_SIZE = "FILE_SIZE"
    FILESYSTEM = "FILESYSTEM"
    NETWORK = "NETWORK"


@dataclass(frozen=True, slots=True)
class Violation:
    """A limit or policy the exec ran into.

    `inferred` is False when the driver observed the fact itself (it killed the process at the
    deadline, the kernel sent SIGXCPU and rusage shows the CPU time, a cgroup counted an OOM kill,
    output was cut) and True when it is a heuristic (a recognised error message in stderr, which
    the sandboxed program controls and could fake or suppress).
    """

    kind: ViolationKind
    message: str
    inferred: bool = False


@dataclass(frozen=True, slots=True)
class ExecResult:
    """The outcome of one exec.

    `exit_code` is the status the shell convention gives: the program's exit status, or 128+N when
    signal N killed it (the sandbox's init folds signals this way, so `signal` is derived from it
    and an `exit(137)` cannot be told apart from SIGKILL; a wall-clock kill is always SIGKILL).
    `stdout`/`stderr` hold at most `limits.max_output_bytes` each (`*_truncated` says more came).
    `cpu_s` is the kernel's rusage (user + system) of the whole process tree. `max_rss_bytes` is
    the peak memory charged to the exec's memory cgroup where the driver has cgroups, else the
    tree's peak RSS from rusage, or 0 when that cannot be told apart from the driver's own size.
    """

    exit_code: int
    signal: int | None
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    duration_s: float
    cpu_s: float
    max_rss_bytes: int
    violations: tuple[Violation, ...] = ()

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.violations

    @property
    def timed_out(self) -> bool:
        return self.has(ViolationKind.TIMEOUT)

    def has(self, kind: ViolationKind) -> bool:
        return any(v.kind == kind for v in self.violations)

    @property
    def stdout_text(self) -> str:
        return self.stdout.decode("utf-8", "replace")

    @property
    def stderr_text(self) -> str:
        return self.stderr.decode("utf-8", "replace")


@dataclass(frozen=True, slots=True)
class SandboxSpec:
    """What to create: initial files (relative path -> content), limits, network policy, env, TTL."""

    files: Mapping[str, bytes | str] = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)
    network: bool = False
    env: Mapping[str, str] = field(default_factory=dict)
    ttl_seconds: float = 3600.0
    labels: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.limits, Limits):
            raise InvalidSandboxRequest("limits must be a Limits instance", field="limits")
        if not isinstance(self.network, bool):
            raise InvalidSandboxRequest("network must be a bool", field="network")
        if isinstance(self.ttl_seconds, bool) or not 0 < self.ttl_seconds <= MAX_TTL_SECONDS:
            raise InvalidSandboxRequest(
                f"ttl_seconds={self.ttl_seconds!r} is out of range (0, {MAX_TTL_SECONDS}]",
                field="ttl_seconds",
            )
        validate_env(self.env, field_name="env")
        if len(self.labels) > MAX_LABELS or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.labels.items()
        ):
            raise InvalidSandboxRequest(f"labels must be at most {MAX_LABELS} str->str pairs", field="labels")


@dataclass(frozen=True, slots=True)
class SandboxHandle:
    """A live sandbox, as returned by `create`. Drivers accept the handle or its `id`."""

    id: str
    spec: SandboxSpec
    created_at: float
    expires_at: float
    from_warm_pool: bool = False

    @property
    def labels(self) -> Mapping[str, str]:
        return self.spec.labels

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.expires_at


@dataclass(frozen=True, slots=True)
class FileInfo:
    """One entry of `list_files`; symlinks are reported, never followed."""

    path: str
    kind: str  # "file" | "dir" | "symlink" | "other"
    size: int
    mode: int
    mtime: float


SandboxRef = SandboxHandle | str


@runtime_checkable
class SandboxDriver(Protocol):
    """Isolation backend. All methods are safe to call concurrently from one event loop."""

    async def start(self) -> None:
        """Check the host can isolate (else SandboxDriverUnavailable) and start background work."""

    async def close(self) -> None:
        """Destroy every sandbox this driver created and stop background work."""

    async def create(self, spec: SandboxSpec | None = None) -> SandboxHandle: ...

    async def get(self, sandbox: SandboxRef) -> SandboxHandle:
        """The live sandbox, or SandboxNotFound."""

    async def list_sandboxes(self) -> list[SandboxHandle]: ...

    async def exec(
        self,
        sandbox: SandboxRef,
        argv: Sequence[str],
        *,
        stdin: bytes = b"",
        timeout: float | None = None,  # noqa: ASYNC109 - the sandbox's wall-clock limit, not a cancel scope
        env: Mapping[str, str] | None = None,
        cwd: str = ".",
    ) -> ExecResult:
        """Run argv (looked up on the sandbox's PATH) with cwd relative to the workspace.

        `timeout` overrides `limits.wall_seconds` for this exec. Limit breaches are results (with
        violations), not exceptions; exceptions mean a bad request or a broken driver.
        """

    async def write_files(self, sandbox: SandboxRef, files: Mapping[str, bytes | str]) -> None: ...

    async def read_files(self, sandbox: SandboxRef, paths: Sequence[str]) -> dict[str, bytes]: ...

    async def list_files(
        self, sandbox: SandboxRef, path: str = ".", *, recursive: bool = True
    ) -> list[FileInfo]: ...

    async def destroy(self, sandbox: SandboxRef) -> None:
        """Kill running execs and delete the workspace; SandboxNotFound if it is already gone."""


def validate_env(env: Mapping[str, str], *, field_name: str) -> None:
    total = 0
    for key, value in env.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidSandboxRequest(f"{field_name} keys and values must be str", field=field_name)
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise InvalidSandboxRequest(
                f"{field_name} has an invalid variable name {key!r} (empty, '=' or NUL)", field=field_name
            )
        total += len(key) + len(value) + 2
    if total > MAX_ENV_BYTES:
        raise InvalidSandboxRequest(f"{field_name} is larger than {MAX_ENV_BYTES} bytes", field=field_name)


def validate_argv(argv: Sequence[str]) -> list[str]:
    if isinstance(argv, str | bytes):
        raise InvalidSandboxRequest("argv must be a list of strings, not a single string", field="argv")
    args = list(argv)
    if not args:
        raise InvalidSandboxRequest("argv must not be empty", field="argv")
    if not all(isinstance(a, str) for a in args):
        raise InvalidSandboxRequest("argv must contain only strings", field="argv")
    if not args[0] or any("\0" in a for a in args):
        raise InvalidSandboxRequest("argv[0] must be non-empty and no argument may contain NUL", field="argv")
    if sum(len(a) + 1 for a in args) > MAX_ARGV_BYTES:
        raise InvalidSandboxRequest(f"argv is larger than {MAX_ARGV_BYTES} bytes", field="argv")
    return args
