"""The default isolation driver: one bubblewrap container per exec, over a per-sandbox workspace.

A sandbox is a slot (workspace directory, unprivileged uid of its own, optional cgroup; see
`workspace`) plus its spec. Each exec is a fresh bwrap container over that workspace (the command
line and what the program sees: `bwrap_command`), run with a deadline and capped capture
(`process`), and turned into an ExecResult with violations (`violations`).

tini is the container's pid 1: when the program exits, tini exits and the kernel kills whatever
is left in the pid namespace, so no process survives an exec; at the deadline or on destroy the
driver kills pid 1 itself, to the same effect. Slots come from a warm pool when it has one.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import shutil
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rlfleet.sandbox import cgroups as cg
from rlfleet.sandbox import paths as ws_paths
from rlfleet.sandbox.bwrap_command import (
    HOST_ENV,
    SETPRIV,
    TINI_CANDIDATES,
    Sandboxing,
    bwrap_reported_exit,
    kill_sandbox_init,
)
from rlfleet.sandbox.config import BubblewrapConfig
from rlfleet.sandbox.driver import (
    MAX_STDIN_BYTES,
    ExecResult,
    FileInfo,
    SandboxHandle,
    SandboxRef,
    SandboxSpec,
    validate_argv,
    validate_env,
)
from rlfleet.sandbox.errors import (
    InvalidSandboxRequest,
    SandboxDriverUnavailable,
    SandboxNotFound,
    SandboxQuotaExceeded,
)
from rlfleet.sandbox.limits import LIMIT_RANGES, Limits
from rlfleet.sandbox.pool import WarmPool
from rlfleet.sandbox.process import run_captured
from rlfleet.sandbox.uid_lease import UidLease, lease_uid_range
from rlfleet.sandbox.violations import exec_result
from rlfleet.sandbox.workspace import (
    LOCK_NAME,
    UID_RANGE_NAME,
    Slot,
    UidAllocator,
    WorkspaceQuota,
    kill_uid_processes,
    prepare_slot,
    remove_slot,
    sweep_root,
    workspace_full,
)

log = logging.getLogger(__name__)

_GONE_MEMORY = 10_000


@dataclass(eq=False)
class _Live:
    handle: SandboxHandle
    slot: Slot
    kills: set[Callable[[], None]] = field(default_factory=set)
    running: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    destroyed: bool = False

    def __post_init__(self) -> None:
        self.idle.set()  # no exec running


class BubblewrapDriver:
    """`SandboxDriver` on bubblewrap. Must run as root (it creates namespaces and switches uids)."""

    def __init__(self, config: BubblewrapConfig | None = None) -> None:
        self.config = config or BubblewrapConfig()
        self._uids: UidAllocator | None = None  # on the range leased at start()
        self._uid_lease: UidLease | None = None
        self._quota = WorkspaceQuota(self.config.workspace_bytes, self.config.workspace_inodes)
        self._sandboxes: dict[str, _Live] = {}
        self._gone: OrderedDict[str, str] = OrderedDict()  # id -> why, for clear NOT_FOUND messages
        self._pool = WarmPool(self.config.pool_size, self._make_slot, self._discard_slot)
        self._cgroups: cg.CgroupSupport | None = None
        self._lock_fd: int | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._started = self._closed = False
        self._sandboxing: Sandboxing | None = None  # set by start()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            return
        self._sandboxing = self._check_host()
        root = self.config.root
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(root, 0o700)
        self._lock_root(root)
        try:
            self._lease_uids(root)
            lease = self._uid_lease
            assert lease is not None
            swept = sweep_root(root)
            # Only the leased range: processes there are this root's predecessor's (or strays in a
            # pinned range); any other uid may belong to another driver on the host.
            kill_uid_processes(lease.uids.first, lease.uids.count)
            self._cgroups = self._setup_cgroups(root)
        except BaseException:  # nothing started yet: give the range and the root back
            if self._uid_lease is not None:
                self._uid_lease.release()
            self._unlock_root()
            raise
        self._started = True
        try:
            await self._self_test()
        except BaseException:
            await self.close()
            raise
        self._pool.start()
        self._reaper = asyncio.create_task(self._reap_expired(), name="sandbox-ttl-reaper")
        log.info(
            "bubblewrap sandbox driver ready",
            extra={"root": str(root), "swept": swept, "enforcement": self.enforcement,
                   "uid_base": lease.uids.first, "uid_count": lease.uids.count},
        )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await self._pool.close()
        for live in list(self._sandboxes.values()):
            await self._destroy(live, "driver closed")
        if self._cgroups is not None and self._cgroups.available:
            self._cgroups.close()
        if self._uid_lease is not None:
            self._uid_lease.release()
        self._unlock_root()

    def _unlock_root(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    @property
    def uid_range(self) -> tuple[int, int] | None:
        """(first uid, count) this driver leased host-wide; None before start."""
        lease = self._uid_lease
        return (lease.uids.first, lease.uids.count) if lease is not None and lease.held else None

    def _lease_uids(self, root: Path) -> None:
        """Lease the uid range host-wide (see `uid_lease`), preferring the one this root had."""
        remembered = root / UID_RANGE_NAME
        preferred = None
        with contextlib.suppress(OSError, ValueError):
            first, count = (int(x) for x in remembered.read_text().split())
            preferred = first if count == self.config.max_sandboxes else None
        lease = lease_uid_range(
            self.config.uid_lease_dir,
            self.config.max_sandboxes,
            pinned=self.config.uid_base,
            search_from=self.config.uid_search_from,
            search_to=self.config.uid_search_to,
            preferred=preferred,
            root=str(root.resolve()),
        )
        try:
            remembered.write_text(f"{lease.uids.first} {lease.uids.count}\n")
            self._uids = UidAllocator(lease.uids.first, lease.uids.count)
        except BaseException:
            lease.release()
            raise
        self._uid_lease = lease

    async def __aenter__(self) -> BubblewrapDriver:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def enforcement(self) -> dict[str, str]:
        """How each limit is enforced on this host (for logs, /status and the docs)."""
        cgroup = self._cgroups is not None and self._cgroups.available
        usage = (
            "kernel rusage of the whole tree (tini as pid 1)"
            if self._sandboxing and self._sandboxing.tini
            else "bwrap's own usage only (no tini)"
        )
        return {
            "accounting": usage + (", memory peak from the exec's cgroup" if cgroup else ", no memory peak"),
            "cgroups": self._cgroups.reason if self._cgroups else "not started",
            "memory": "memory cgroup (resident memory incl. tmpfs), OOM kills counted"
            if cgroup
            else "RLIMIT_AS (address space)",
            "processes": "RLIMIT_NPROC on a per-sandbox uid" + (" + pids cgroup" if cgroup else ""),
            "cpu": "RLIMIT_CPU per process (SIGXCPU, then SIGKILL 1 s later); tree total measured",
            "wall": "driver deadline, SIGKILL of the sandbox's pid namespace",
            "file_size": "RLIMIT_FSIZE per file",
            "workspace": f"a tmpfs per sandbox: {self._quota.bytes} bytes, "
                         f"{self._quota.inodes} inodes (ENOSPC)",
            "output": "captured up to max_output_bytes per stream, rest read and dropped",
            "network": "own network namespace with loopback only, unless spec.network",
            "syscalls": "seccomp deny-list (user namespaces, keyrings, bpf, perf, userfaultfd, io_uring)"
            if self._sandboxing and self._sandboxing.seccomp
            else "allow-all seccomp filter (unknown architecture)",
        }

    @property
    def _host(self) -> Sandboxing:
        if self._sandboxing is None:
            raise SandboxDriverUnavailable("the sandbox driver is not started", reason="not_running")
        return self._sandboxing

    @property
    def _allocator(self) -> UidAllocator:
        if self._uids is None:
            raise SandboxDriverUnavailable("the sandbox driver is not started", reason="not_running")
        return self._uids

    @property
    def pool(self) -> WarmPool[Slot]:
        return self._pool

    @property
    def uses_cgroups(self) -> bool:
        return self._cgroups is not None and self._cgroups.available

    def host_info(self, sandbox: SandboxRef) -> dict[str, object]:
        """Where a sandbox lives on the host (for operators and tests; never sent to clients)."""
        slot = self._live(sandbox, allow_expired=True).slot
        return {"workspace": slot.work, "dir": slot.dir, "uid": slot.uid, "cgroup": slot.cgroup is not None}

    # -- sandboxes ---------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec | None = None) -> SandboxHandle:
        self._require_running()
        spec = spec if spec is not None else SandboxSpec()
        if not isinstance(spec, SandboxSpec):
            raise InvalidSandboxRequest("spec must be a SandboxSpec", field="spec")
        files = _encode_files(spec.files, spec.limits, self.config.max_write_bytes)
        pooled = self._pool.take()
        slot = pooled or prepare_slot(self.config.root, self._allocator, self._cgroups, self._quota)
        try:
            if slot.cgroup is not None:
                # + tini, which lives in the exec's cgroup too (bwrap's monitor stays outside).
                tasks = spec.limits.max_processes + self._host.init_tasks()
                slot.cgroup.set_limits(memory_bytes=spec.limits.memory_bytes, max_tasks=tasks)
            if files:
                await asyncio.to_thread(self._write_all, slot, files)
        except BaseException:
            await asyncio.to_thread(remove_slot, slot, self._allocator)
            raise
        now = time.time()
        handle = SandboxHandle(slot.id, spec, now, now + spec.ttl_seconds, from_warm_pool=pooled is not None)
        self._sandboxes[slot.id] = _Live(handle, slot)
        return handle

    async def get(self, sandbox: SandboxRef) -> SandboxHandle:
        return self._live(sandbox).handle

    async def list_sandboxes(self) -> list[SandboxHandle]:
        return [live.handle for live in self._sandboxes.values() if not live.handle.expired()]

    async def destroy(self, sandbox: SandboxRef) -> None:
        await self._destroy(self._live(sandbox, allow_expired=True), "destroyed")

    async def _destroy(self, live: _Live, reason: str) -> None:
        if live.destroyed:
            return
        live.destroyed = True
        self._sandboxes.pop(live.handle.id, None)
        self._remember_gone(live.handle.id, reason)
        for kill in list(live.kills):
            kill()
        try:
            async with asyncio.timeout(10):
                await live.idle.wait()
        except TimeoutError:
            log.warning("execs of sandbox %s still running 10s after kill", live.handle.id)
        await asyncio.to_thread(remove_slot, live.slot, self._allocator)

    # -- exec --------------------------------------------------------------------------------

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
        live = self._live(sandbox)
        args = validate_argv(argv)
        limits = live.handle.spec.limits
        timeout_s = limits.wall_seconds if timeout is None else _check_timeout(timeout)
        validate_env(env or {}, field_name="env")
        if not isinstance(stdin, bytes | bytearray | memoryview) or len(stdin) > MAX_STDIN_BYTES:
            raise InvalidSandboxRequest(f"stdin must be bytes of at most {MAX_STDIN_BYTES}", field="stdin")
        cwd_rel = "/".join(ws_paths.split_relpath(cwd, field="cwd", allow_root=True))
        if not await asyncio.to_thread(ws_paths.is_dir, str(live.slot.work), cwd_rel or "."):
            raise InvalidSandboxRequest(f"cwd {cwd!r} is not a directory in the workspace", field="cwd")
        sandbox_env = {**self._host.base_env(), **live.handle.spec.env, **(env or {})}
        if live.destroyed:
            raise SandboxNotFound(live.handle.id, "destroyed")
        sandbox_cg = live.slot.cgroup
        exec_cg = sandbox_cg.exec_cgroup() if sandbox_cg else None
        pids_hits_before = sandbox_cg.pids_max_hits() if sandbox_cg else 0

        killers: list[Callable[[], None]] = []

        def registered(kill: Callable[[], None]) -> None:
            killers.append(kill)
            live.kills.add(kill)

        gate = self._host.gate(live.handle.spec, exec_cg)
        etc_args: list[str] = []
        etc_fds: list[int] = []
        full_before = workspace_full(live.slot.work)
        live.running += 1
        live.idle.clear()
        try:
            etc_args, etc_fds = self._host.open_etc(live.slot, limits.max_file_bytes)
            outcome = await run_captured(
                lambda status_fd: self._host.command(
                    live.slot,
                    live.handle.spec,
                    args,
                    env=sandbox_env,
                    cwd=cwd_rel,
                    status_fd=status_fd,
                    gate_fd=gate.read_fd,
                    etc_args=etc_args,
                ),
                env=HOST_ENV,
                stdin=bytes(stdin),
                timeout_s=timeout_s,
                max_output_bytes=limits.max_output_bytes,
                status_fd=True,
                on_spawn=registered,
                stop=kill_sandbox_init,
                pass_fds=(gate.read_fd, *etc_fds),
                on_status=gate.on_status,
            )
            usage = exec_cg.usage() if exec_cg else None
            pids_hits = sandbox_cg.pids_max_hits() - pids_hits_before if sandbox_cg else 0
            pids_hits = max(pids_hits, usage.pids_max_hits if usage else 0)
        finally:
            await gate.wait()
            gate.close()
            _close_all(etc_fds)
            if exec_cg is not None:
                await asyncio.to_thread(exec_cg.remove)
            for kill in killers:
                live.kills.discard(kill)
            live.running -= 1
            if live.running == 0:
                live.idle.set()
        if live.destroyed:
            raise SandboxNotFound(live.handle.id, "destroyed while the exec ran")
        if not outcome.timed_out and not bwrap_reported_exit(outcome.status_data):
            raise SandboxDriverUnavailable(
                "bubblewrap could not set up the sandbox: "
                f"{outcome.stderr.data.decode(errors='replace').strip()}", reason="sandbox_setup_failed",
                sandbox_id=live.handle.id,
            )
        # Filled by this exec: full now and not before (statvfs of a tmpfs: no I/O, fine on the loop).
        # A workspace that was already full is not held against every later exec.
        bytes_full, inodes_full = workspace_full(live.slot.work)
        full = (bytes_full and not full_before[0], inodes_full and not full_before[1])
        return exec_result(outcome, limits, timeout_s, usage, pids_hits, live.handle.spec.network,
                           workspace=(self._quota, *full))

    # -- files -------------------------------------------------------------------------------

    async def write_files(self, sandbox: SandboxRef, files: Mapping[str, bytes | str]) -> None:
        live = self._live(sandbox)
        encoded = _encode_files(files, live.handle.spec.limits, self.config.max_write_bytes)
        await asyncio.to_thread(self._write_all, live.slot, encoded)

    async def read_files(self, sandbox: SandboxRef, paths: Sequence[str]) -> dict[str, bytes]:
        live = self._live(sandbox)
        if isinstance(paths, str):
            raise InvalidSandboxRequest("paths must be a list of paths, not one string", field="paths")
        for p in paths:
            ws_paths.split_relpath(p)
        return await asyncio.to_thread(self._read_all, live.slot, list(paths))

    async def list_files(
        self, sandbox: SandboxRef, path: str = ".", *, recursive: bool = True
    ) -> list[FileInfo]:
        live = self._live(sandbox)
        ws_paths.split_relpath(path, allow_root=True)
        return await asyncio.to_thread(
            ws_paths.list_dir,
            str(live.slot.work),
            path,
            recursive=recursive,
            max_entries=self.config.max_list_entries,
        )

    def _write_all(self, slot: Slot, files: dict[str, bytes]) -> None:
        for path, data in files.items():
            try:
                ws_paths.write_file(str(slot.work), path, data, owner=(slot.uid, slot.uid))
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                no_bytes, _ = workspace_full(slot.work)
                quota, limit = ("workspace_bytes", self._quota.bytes) if no_bytes else (
                    "workspace_inodes", self._quota.inodes)
                raise SandboxQuotaExceeded(
                    f"writing {path!r} would pass the workspace's {quota}={limit} quota",
                    quota=quota, limit=limit, sandbox_id=slot.id, path=path) from None

    def _read_all(self, slot: Slot, wanted: list[str]) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        budget = self.config.max_read_bytes
        for path in wanted:
            data = ws_paths.read_file(str(slot.work), path, max_bytes=budget)
            budget -= len(data)
            out[path] = data
        return out

    # -- internals ---------------------------------------------------------------------------

    def _live(self, sandbox: SandboxRef, *, allow_expired: bool = False) -> _Live:
        sandbox_id = sandbox.id if isinstance(sandbox, SandboxHandle) else sandbox
        if not isinstance(sandbox_id, str):
            raise InvalidSandboxRequest("sandbox must be a SandboxHandle or an id", field="sandbox_id")
        live = self._sandboxes.get(sandbox_id)
        if live is None:
            raise SandboxNotFound(sandbox_id, self._gone.get(sandbox_id, "unknown"))
        if not allow_expired and live.handle.expired():
            raise SandboxNotFound(sandbox_id, "expired")
        return live

    def _remember_gone(self, sandbox_id: str, reason: str) -> None:
        self._gone[sandbox_id] = reason
        while len(self._gone) > _GONE_MEMORY:
            self._gone.popitem(last=False)

    def _require_running(self) -> None:
        if not self._started or self._closed:
            raise SandboxDriverUnavailable("the sandbox driver is not running", reason="not_running")

    async def _make_slot(self) -> Slot:
        return prepare_slot(self.config.root, self._allocator, self._cgroups, self._quota)

    async def _discard_slot(self, slot: Slot) -> None:
        remove_slot(slot, self._allocator)

    async def _reap_expired(self) -> None:
        while True:
            await asyncio.sleep(self.config.reap_interval_s)
            for live in [lv for lv in self._sandboxes.values() if lv.handle.expired()]:
                try:
                    await self._destroy(live, "expired")
                except Exception:
                    log.exception("failed to destroy expired sandbox %s", live.handle.id)

    def _check_host(self) -> Sandboxing:
        if os.geteuid() != 0:
            raise SandboxDriverUnavailable(
                "the bubblewrap driver must run as root (it switches each sandbox to its own uid)",
                reason="not_root",
            )
        bwrap = shutil.which(self.config.bwrap)
        if bwrap is None:
            raise SandboxDriverUnavailable(f"{self.config.bwrap!r} not found on PATH", reason="bwrap_missing")
        if not os.access(SETPRIV, os.X_OK):
            raise SandboxDriverUnavailable(
                f"{SETPRIV} (util-linux) is missing", reason="tool_missing", tool=SETPRIV
            )
        tini = next((t for t in TINI_CANDIDATES if os.access(t, os.X_OK)), None)
        if tini is None:
            log.warning("%s missing: sandboxes use bwrap's init, so cpu_s undercounts", TINI_CANDIDATES[-1])
        return Sandboxing.for_host(
            bwrap=bwrap,
            tini=tini,
            python_prefix=self._python_prefix(),
            extra_ro_binds=self.config.extra_ro_binds,
            tmp_size_bytes=self.config.tmp_size_bytes,
        )

    def _lock_root(self, root: Path) -> None:
        fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SandboxDriverUnavailable(
                f"another driver is using {root}; give each driver its own root and uid range",
                reason="root_in_use",
            ) from None
        self._lock_fd = fd

    def _setup_cgroups(self, root: Path) -> cg.CgroupSupport | None:
        if self.config.cgroups == "off":
            return cg.CgroupSupport(0, {}, "off (config)")
        name = "rlfleet-sandbox-" + hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:12]
        support = cg.detect(name, cgroup_parent=self.config.cgroup_parent)
        if not support.available:
            if self.config.cgroups == "require":
                raise SandboxDriverUnavailable(
                    f"cgroups required but unusable: {support.reason}", reason="no_cgroups"
                )
            log.warning("sandbox cgroups unavailable (%s); limits fall back to rlimits only", support.reason)
            return support
        support.sweep()
        return support

    def _python_prefix(self) -> str:
        return os.path.realpath(self.config.python_prefix or sys.base_prefix)

    async def _self_test(self) -> None:
        """Fail at start, with bwrap's own words, rather than on the first episode."""
        handle = await self.create(SandboxSpec(ttl_seconds=60))
        try:
            result = await self.exec(handle, ["python3", "-c", "import sys; print(sys.prefix)"], timeout=20)
        finally:
            await self.destroy(handle)
        if result.exit_code != 0 or result.stdout_text.strip() != self._python_prefix():
            raise SandboxDriverUnavailable(
                f"sandbox self-test failed (exit {result.exit_code}): "
                f"{result.stdout_text} {result.stderr_text}".strip(), reason="self_test_failed",
            )


def _close_all(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())


def _check_timeout(timeout: float) -> float:
    lo, hi = LIMIT_RANGES["wall_seconds"]
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not lo <= timeout <= hi:
        raise InvalidSandboxRequest(
            f"timeout={timeout!r} is out of range [{lo:g}, {hi:g}] seconds", field="timeout"
        )
    return float(timeout)


def _encode_files(files: Mapping[str, bytes | str], limits: Limits, max_total: int) -> dict[str, bytes]:
    if not isinstance(files, Mapping):
        raise InvalidSandboxRequest("files must be a mapping of relative path to content", field="files")
    out: dict[str, bytes] = {}
    total = 0
    for path, content in files.items():
        ws_paths.split_relpath(path)
        data = content.encode() if isinstance(content, str) else content
        if not isinstance(data, bytes | bytearray | memoryview):
            raise InvalidSandboxRequest(f"content of {path!r} must be bytes or str", field="files", path=path)
        data = bytes(data)
        if len(data) > limits.max_file_bytes:
            raise InvalidSandboxRequest(
                f"{path!r} is {len(data)} bytes, over max_file_bytes={limits.max_file_bytes}",
                field="files",
                path=path,
            )
        total += len(data)
        out[path] = data
    if total > max_total:
        raise InvalidSandboxRequest(
            f"files total {total} bytes, over the {max_total}-byte limit", field="files"
        )
    return out
