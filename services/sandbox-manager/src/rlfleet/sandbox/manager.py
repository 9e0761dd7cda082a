"""The sandbox manager: a driver, plus what the service adds around it.

- a record per live sandbox: its session, client, exec count and every violation so far (GetSandbox);
- caps on open sandboxes, in all (one manager serves one run) and per client (`OpenCaps`): a client
  that opens sandboxes as fast as it can gets RESOURCE_EXHAUSTED at its cap, and the others keep theirs;
- a lease in Redis per sandbox, so a restarted manager knows what its predecessor left (`leases`);
- a reaper that destroys sandboxes past their TTL and drops their leases;
- a heartbeat that tells managers elsewhere this one is alive.

Proto-free: the servicer (`servicer`) translates requests and results.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from rlfleet.common import security
from rlfleet.sandbox.driver import ExecResult, SandboxDriver, SandboxHandle, SandboxSpec, Violation
from rlfleet.sandbox.errors import (
    InvalidSandboxRequest,
    SandboxDriverUnavailable,
    SandboxNotFound,
    SandboxQuotaExceeded,
)
from rlfleet.sandbox.leases import LeaseStore, Recovery
from rlfleet.sandbox.metrics import SandboxMetrics
from rlfleet.sandbox.policy import RequestPolicy

log = logging.getLogger(__name__)

MAX_RECORDED_VIOLATIONS = 1000
ANONYMOUS_CLIENT = "anonymous"  # callers that do not say who they are share one client's cap
MAX_CLIENT_ID_CHARS = 128


@dataclass(frozen=True)
class OpenCaps:
    """How many sandboxes may be open at once: in all (this manager serves one run), and per client."""

    per_run: int
    per_client: int


@dataclass(frozen=True)
class RecordedViolation:
    violation: Violation
    at: float  # unix seconds


@dataclass
class SandboxRecord:
    handle: SandboxHandle
    session_id: str
    client_id: str = ANONYMOUS_CLIENT
    owner: str = ""  # the principal that created it; only it (and services) see it
    exec_count: int = 0
    violations: deque[RecordedViolation] = field(
        default_factory=lambda: deque(maxlen=MAX_RECORDED_VIOLATIONS))


@dataclass(frozen=True)
class NewFile:
    path: str
    content: bytes
    mode: int = 0  # 0 = 0644


@dataclass(frozen=True)
class ReadLimits:
    max_total_bytes: int
    default_per_file: int


class SandboxManager:
    def __init__(self, driver: SandboxDriver, leases: LeaseStore, policy: RequestPolicy,
                 read_limits: ReadLimits, *, reap_interval_s: float, pool_size: Callable[[], int] = lambda: 0,
                 caps: OpenCaps | None = None) -> None:
        self.driver = driver
        self.caps = caps or OpenCaps(per_run=1 << 30, per_client=1 << 30)
        self._opening: Counter[str] = Counter()  # creates in flight, per client (counted against the caps)
        self.leases = leases
        self.policy = policy
        self.read_limits = read_limits
        self.reap_interval_s = reap_interval_s
        self.records: dict[str, SandboxRecord] = {}
        self.metrics = SandboxMetrics(active=lambda: len(self.records), pool_size=pool_size)
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> Recovery:
        """Starts the driver (which sweeps its root and uid range), then removes stale leases."""
        await self.driver.start()
        recovery = await self.leases.recover()
        self.metrics.stale_leases.add(len(recovery.predecessor_leases) + len(recovery.dead_owner_leases))
        await self.leases.heartbeat()
        self._tasks = [asyncio.create_task(self._every(self.reap_interval_s, self.reap_expired),
                                           name="sandbox-reaper"),
                       asyncio.create_task(self._every(self.leases.heartbeat_s, self.leases.heartbeat),
                                           name="sandbox-heartbeat")]
        return recovery

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.driver.close()  # destroys every sandbox it holds
        for sandbox_id in list(self.records):
            await self._forget(sandbox_id)
        await self.leases.retire()

    # -- sandboxes ---------------------------------------------------------------------------

    async def create(self, *, files: Sequence[NewFile], limits: Mapping[str, float], network: bool,
                     env: Mapping[str, str], ttl_s: float, labels: Mapping[str, str], session_id: str,
                     client_id: str = ANONYMOUS_CLIENT) -> SandboxRecord:
        spec = SandboxSpec(files={f.path: f.content for f in files}, limits=self.policy.limits(limits),
                           network=self.policy.network(network), env=dict(env),
                           ttl_seconds=self.policy.ttl(ttl_s), labels=dict(labels))
        _check_modes(files)
        client_id = _check_client_id(client_id)
        self._check_caps(client_id)
        self._opening[client_id] += 1
        try:
            handle = await self.driver.create(spec)
        finally:
            self._opening[client_id] -= 1
            if not self._opening[client_id]:
                del self._opening[client_id]
        record = SandboxRecord(handle, session_id, client_id, security.caller().owner)
        self.records[handle.id] = record
        try:
            await self.leases.grant(handle.id, created_at=handle.created_at, expires_at=handle.expires_at,
                                    session_id=session_id)
            await self._apply_modes(handle.id, files)
        except BaseException:
            await self.destroy(handle.id)
            raise
        self.metrics.created(handle.from_warm_pool)
        return record

    def open_count(self, client_id: str | None = None) -> int:
        """Sandboxes open (or being created) in all, or for one client."""
        if client_id is None:
            return len(self.records) + sum(self._opening.values())
        return sum(1 for r in self.records.values() if r.client_id == client_id) + self._opening[client_id]

    def _check_caps(self, client_id: str) -> None:
        total, mine = self.open_count(), self.open_count(client_id)
        if total >= self.caps.per_run:
            self.metrics.refused("sandboxes_per_run")
            raise SandboxQuotaExceeded(
                f"this run has {total} sandboxes open, its cap (max_open_sandboxes={self.caps.per_run}); "
                "destroy some first", quota="max_open_sandboxes", limit=self.caps.per_run, open=total,
                client_id=client_id)
        if mine >= self.caps.per_client:
            self.metrics.refused("sandboxes_per_client")
            raise SandboxQuotaExceeded(
                f"client {client_id!r} has {mine} sandboxes open, its cap "
                f"(max_sandboxes_per_client={self.caps.per_client}); destroy some first",
                quota="max_sandboxes_per_client", limit=self.caps.per_client, open=mine, client_id=client_id)

    async def get(self, sandbox_id: str) -> SandboxRecord:
        await self.driver.get(sandbox_id)  # NOT_FOUND (with the reason) when gone or expired
        record = self.records.get(sandbox_id)
        # Another caller's sandbox is answered as if it did not exist.
        if record is None or not security.caller().may_own(record.owner):
            raise SandboxNotFound(sandbox_id)
        return record

    async def destroy(self, sandbox_id: str) -> None:
        try:
            await self.driver.destroy(sandbox_id)
        finally:
            if sandbox_id in self.records:
                await self._forget(sandbox_id)

    async def reap_expired(self) -> None:
        now = time.time()
        for sandbox_id in [i for i, r in self.records.items() if r.handle.expired(now)]:
            with contextlib.suppress(SandboxNotFound):  # the driver's own reaper may have been first
                await self.destroy(sandbox_id)
            log.info("sandbox expired", extra={"sandbox_id": sandbox_id})

    # -- exec and files ----------------------------------------------------------------------

    async def exec(self, sandbox_id: str, argv: Sequence[str], *, stdin: bytes, timeout_s: float,
                   env: Mapping[str, str], cwd: str) -> ExecResult:
        record = await self.get(sandbox_id)
        timeout = self.policy.exec_timeout(timeout_s)
        started = time.monotonic()
        result = await self.driver.exec(sandbox_id, argv, stdin=stdin, timeout=timeout, env=env,
                                        cwd=cwd or ".")
        self.metrics.executed(result, time.monotonic() - started)
        record.exec_count += 1
        now = time.time()
        record.violations.extend(RecordedViolation(v, now) for v in result.violations)
        return result

    async def write_files(self, sandbox_id: str, files: Sequence[NewFile]) -> None:
        await self.get(sandbox_id)
        _check_modes(files)
        await self.driver.write_files(sandbox_id, {f.path: f.content for f in files})
        await self._apply_modes(sandbox_id, files)

    async def read_files(self, sandbox_id: str, paths: Sequence[str],
                         max_bytes_per_file: int) -> tuple[dict[str, bytes], list[str]]:
        """The files that exist, and the paths that do not; a file over the per-file cap is an error."""
        await self.get(sandbox_id)
        per_file = min(max_bytes_per_file or self.read_limits.default_per_file,
                       self.read_limits.max_total_bytes)
        found: dict[str, bytes] = {}
        missing: list[str] = []
        total = 0
        for path in paths:
            try:
                data = (await self.driver.read_files(sandbox_id, [path]))[path]
            except InvalidSandboxRequest as exc:
                if exc.details.get("reason") == "not_found":
                    missing.append(path)
                    continue
                raise
            if len(data) > per_file:
                raise InvalidSandboxRequest(f"path {path!r} is {len(data)} bytes, "
                                            f"over max_bytes_per_file={per_file}",
                                            field="max_bytes_per_file", path=path)
            total += len(data)
            if total > self.read_limits.max_total_bytes:
                raise InvalidSandboxRequest(
                    f"the files total more than {self.read_limits.max_total_bytes} bytes; "
                    "read fewer per call", field="paths")
            found[path] = data
        return found, missing

    async def list_files(self, sandbox_id: str) -> list[str]:
        """Every non-directory entry of the workspace (symlinks are listed, never followed)."""
        await self.get(sandbox_id)
        return [info.path for info in await self.driver.list_files(sandbox_id) if info.kind != "dir"]

    # -- internals ---------------------------------------------------------------------------

    async def _forget(self, sandbox_id: str) -> None:
        self.records.pop(sandbox_id, None)
        await self.leases.release(sandbox_id)

    async def _apply_modes(self, sandbox_id: str, files: Sequence[NewFile]) -> None:
        """Non-default modes are set from inside the sandbox, as its own user: the host never
        chmods a path the untrusted workspace could have redirected."""
        by_mode: dict[int, list[str]] = {}
        for f in files:
            if f.mode and f.mode != 0o644:
                by_mode.setdefault(f.mode, []).append(f.path)
        for mode, paths in by_mode.items():
            result = await self.driver.exec(sandbox_id,
                                            ["chmod", format(mode, "o"), "--", *paths], timeout=10)
            if not result.ok:
                raise SandboxDriverUnavailable(f"could not set mode {mode:o}: {result.stderr_text.strip()}",
                                               reason="chmod_failed", sandbox_id=sandbox_id)

    @staticmethod
    async def _every(interval_s: float, job: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await job()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("background job %s failed; retrying in %.1fs", job.__name__, interval_s)


def _check_client_id(client_id: str) -> str:
    client_id = client_id or ANONYMOUS_CLIENT
    if len(client_id) > MAX_CLIENT_ID_CHARS or not client_id.isprintable():
        raise InvalidSandboxRequest(f"client_id must be at most {MAX_CLIENT_ID_CHARS} printable characters",
                                    field="client_id")
    return client_id


def _check_modes(files: Sequence[NewFile]) -> None:
    for f in files:
        if not 0 <= f.mode <= 0o777:
            raise InvalidSandboxRequest(f"mode {f.mode:o} of {f.path!r} is outside 0..0777 (no setuid bits)",
                                        field="files.mode", path=f.path)
