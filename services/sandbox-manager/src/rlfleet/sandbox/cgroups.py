"""Optional per-sandbox cgroups: a hard memory limit with OOM evidence, and a pids limit.

rlimits alone bound memory only as address space (RLIMIT_AS counts reservations, misses tmpfs and
gives no proof of *why* a program died). A memory cgroup bounds what is actually resident (including
the sandbox's /tmp) and counts OOM kills, which lets the driver report MEMORY as an observed fact;
its peak is also the only clean per-exec memory figure (rusage's maxrss of a child forked from the
driver starts at the driver's own size). The pids controller bounds the task count independently
of uids. Limits sit on the sandbox's cgroup; each exec runs in a leaf below it, so counters and the
peak are per exec while the budget is shared by everything running in the sandbox.

Used when the host lets us: cgroup v1 with writable `memory` and `pids` hierarchies, or cgroup v2
where `cgroup_parent` is a delegated cgroup with both controllers in its subtree_control (v2 forbids
controllers on a cgroup that holds processes, so the driver cannot enable them in its own cgroup).
Anything else falls back to rlimits and says why (`CgroupSupport.reason`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


def _read_kv(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _read_int(path: Path) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return 0


def _procs(d: Path) -> list[int]:
    pids: list[int] = []
    with contextlib.suppress(OSError):
        for p in d.rglob("cgroup.procs"):
            with contextlib.suppress(OSError, ValueError):
                pids += [int(x) for x in p.read_text().split()]
    return pids


def _rmdir(d: Path, deadline: float) -> None:
    """rmdir a cgroup; it only succeeds once its last task has been reaped, so kill and retry."""
    while True:
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                log.warning("cgroup %s still busy; leaving it for the next sweep", d)
                return
            for pid in _procs(d):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.005)


@dataclass(frozen=True, slots=True)
class ExecUsage:
    """What the kernel counted for one exec's cgroup."""

    oom_kills: int
    peak_memory_bytes: int
    pids_max_hits: int  # forks refused, as counted in the leaf (cgroup v1 counts them here)


class ExecCgroup:
    """A leaf under the sandbox's cgroup for one exec: per-exec OOM count and memory peak
    (the sandbox-level limits still apply, hierarchically, across concurrent execs)."""

    def __init__(self, version: int, dirs: dict[str, Path]) -> None:
        self.version, self.dirs = version, dirs
        for d in set(dirs.values()):
            d.mkdir()

    @property
    def procs_files(self) -> list[str]:
        return sorted({str(d / "cgroup.procs") for d in self.dirs.values()})

    def add(self, pid: int) -> None:
        """Move process `pid` (and, in v1, its whole thread group) into this leaf."""
        for procs in self.procs_files:
            with open(procs, "w") as f:
                f.write(str(pid))

    def usage(self) -> ExecUsage:
        mem, pids = self.dirs["memory"], self.dirs["pids"]
        refused = _read_kv(pids / "pids.events", "max")
        if self.version == 1:
            return ExecUsage(
                _read_kv(mem / "memory.oom_control", "oom_kill"),
                _read_int(mem / "memory.max_usage_in_bytes"),
                refused,
            )
        return ExecUsage(_read_kv(mem / "memory.events", "oom_kill"), _read_int(mem / "memory.peak"), refused)

    def remove(self, timeout_s: float = 2.0) -> None:
        deadline = time.monotonic() + timeout_s
        for d in set(self.dirs.values()):
            _rmdir(d, deadline)


class SandboxCgroup:
    """The cgroup(s) of one sandbox, holding its limits. v1 has one directory per controller
    ("memory", "pids"), v2 one directory for both. Processes only ever live in exec leaves."""

    def __init__(self, version: int, dirs: dict[str, Path]) -> None:
        self.version, self.dirs = version, dirs
        for d in set(dirs.values()):
            d.mkdir(exist_ok=True)
            if version == 2:  # leaves need the controllers enabled here
                (d / "cgroup.subtree_control").write_text("+memory +pids")

    def set_limits(self, *, memory_bytes: int, max_tasks: int) -> None:
        mem, pids = self.dirs["memory"], self.dirs["pids"]
        if self.version == 1:
            (mem / "memory.limit_in_bytes").write_text(str(memory_bytes))
            # No swap on top: otherwise the limit is memory + swap and hogs thrash instead of dying.
            # (memsw must stay >= limit_in_bytes, so it is written second.)
            with contextlib.suppress(FileNotFoundError):
                (mem / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
        else:
            (mem / "memory.max").write_text(str(memory_bytes))
            with contextlib.suppress(FileNotFoundError):
                (mem / "memory.swap.max").write_text("0")
        (pids / "pids.max").write_text(str(max_tasks))

    def pids_max_hits(self) -> int:
        """Forks refused at pids.max as counted here (cgroup v2 counts them where the limit is;
        v1 in the cgroup of the forking task, see ExecUsage)."""
        return _read_kv(self.dirs["pids"] / "pids.events", "max")

    def exec_cgroup(self) -> ExecCgroup:
        name = f"exec-{secrets.token_hex(6)}"
        return ExecCgroup(self.version, {c: d / name for c, d in self.dirs.items()})

    def kill_all(self) -> None:
        for d in set(self.dirs.values()):
            for pid in _procs(d):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def remove(self, timeout_s: float = 2.0) -> None:
        deadline = time.monotonic() + timeout_s
        for d in set(self.dirs.values()):
            with contextlib.suppress(OSError):
                for leaf in [p for p in d.iterdir() if p.is_dir()]:
                    _rmdir(leaf, deadline)
            _rmdir(d, deadline)


@dataclass(frozen=True, slots=True)
class CgroupSupport:
    """Where sandbox cgroups go, or why there are none (`bases` empty)."""

    version: int
    bases: dict[str, Path]
    reason: str

    @property
    def available(self) -> bool:
        return bool(self.bases)

    def create(self, name: str) -> SandboxCgroup:
        return SandboxCgroup(self.version, {c: base / name for c, base in self.bases.items()})

    def close(self) -> None:
        """Remove the driver's group itself (it is empty once every sandbox is destroyed)."""
        for base in set(self.bases.values()):
            _rmdir(base, time.monotonic() + 1.0)

    def sweep(self) -> int:
        """Remove sandbox cgroups a crashed earlier driver left behind; returns how many."""
        names = {
            p.name for base in self.bases.values() if base.is_dir() for p in base.iterdir() if p.is_dir()
        }
        for name in names:
            SandboxCgroup(self.version, {c: b / name for c, b in self.bases.items()}).remove()
        return len(names)


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount root, mount point, fstype, super options) of cgroup mounts."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if rfields and rfields[0] in ("cgroup", "cgroup2"):
                out.append((fields[3], fields[4], rfields[0], set(rfields[2].split(","))))
    return out


def _own_paths() -> dict[str, str]:
    """controller -> our cgroup path; the v2 entry is keyed ''."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    return out


def _relative(path: str | None, mount_root: str) -> str | None:
    """`path` (from /proc/self/cgroup) relative to a mount showing hierarchy subtree `mount_root`."""
    if path is None:
        return None
    if mount_root == "/":
        return path.lstrip("/")
    if path == mount_root or path.startswith(mount_root + "/"):
        return path[len(mount_root) :].lstrip("/")
    return None  # our cgroup is outside what this mount shows


def _usable(base: Path) -> bool:
    try:
        base.mkdir(exist_ok=True)
        probe = base / f".probe-{os.getpid()}"
        probe.mkdir(exist_ok=True)
        probe.rmdir()
        return True
    except OSError:
        return False


def detect(group_name: str, *, cgroup_parent: str | None = None) -> CgroupSupport:
    """Find where this driver may create sandbox cgroups, under a child group named `group_name`."""
    try:
        mounts, own = _mounts(), _own_paths()
    except OSError as e:
        return CgroupSupport(0, {}, f"cannot read cgroup info: {e}")
    v1: dict[str, Path] = {}
    for controller in ("memory", "pids"):
        for root, point, fstype, opts in mounts:
            rel = _relative(own.get(controller), root)
            if fstype == "cgroup" and controller in opts and rel is not None:
                v1[controller] = Path(point, rel, group_name)
    if len(v1) == 2:
        if all(_usable(b) for b in v1.values()):
            return CgroupSupport(1, v1, "cgroup v1 memory+pids")
        return CgroupSupport(0, {}, "cgroup v1 memory/pids hierarchies are not writable")
    v2_mounts = [(root, point) for root, point, fstype, _ in mounts if fstype == "cgroup2"]
    if not v2_mounts:
        return CgroupSupport(0, {}, "no cgroup v1 memory+pids and no cgroup v2 mount")
    root, point = v2_mounts[0]
    rel = _relative(own.get(""), root)
    if cgroup_parent is None and rel is None:
        return CgroupSupport(0, {}, "our cgroup v2 path is outside the visible cgroup2 mount")
    parent = Path(cgroup_parent) if cgroup_parent else Path(point, rel or "")
    try:
        enabled = set((parent / "cgroup.subtree_control").read_text().split())
    except OSError as e:
        return CgroupSupport(0, {}, f"cgroup v2 parent {parent} unreadable: {e}")
    if not {"memory", "pids"} <= enabled:
        return CgroupSupport(
            0,
            {},
            f"cgroup v2 parent {parent} does not delegate memory+pids (subtree_control: {sorted(enabled)})",
        )
    base = parent / group_name
    if not _usable(base):
        return CgroupSupport(0, {}, f"cgroup v2 parent {parent} is not writable")
    try:
        (base / "cgroup.subtree_control").write_text("+memory +pids")
    except OSError as e:
        return CgroupSupport(0, {}, f"cannot enable memory+pids under {base}: {e}")
    return CgroupSupport(2, {"memory": base, "pids": base}, "cgroup v2 memory+pids")
