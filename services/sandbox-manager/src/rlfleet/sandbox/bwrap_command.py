"""The command line of one sandboxed exec, how its limits are put on it, and reading back what
bwrap reports about it.

    bwrap <namespaces, mounts, --seccomp GATE> setpriv <drop uid> tini argv

bwrap is started by root *without* a user namespace: as root it can bind anything (the Python
prefix may live under root-only /root), and the uid switch after it makes the program a real
unprivileged uid on the host, which is what RLIMIT_NPROC and file permissions act on. (In a user
namespace created by root, the sandbox's uid would map to host root and NPROC would not apply.)
Only util-linux's setpriv runs as root inside, with every capability but SETUID/SETGID/SETPCAP
already dropped by bwrap (and no_new_privs set by it); setpriv drops those too, clears the bounding
set and sets no_new_privs before exec'ing tini, then the program.

Limits are put on bwrap's sandbox process by the driver, not by helper programs in the chain (each
exec'd helper costs about a millisecond of CPU per exec): `ExecGate`. The seccomp filter reaches
bwrap through a pipe (`--seccomp`), which bwrap's sandbox process reads to its end after its mounts
are set up and before it execs anything. The driver learns that process's pid from bwrap's status
fd, moves it into the exec's cgroup, sets its rlimits (which setpriv, tini and the program
inherit), and only then writes the filter and closes the pipe. The gate fails closed: if the
driver dies or gives up before that, the pipe ends empty, the kernel refuses an empty filter and
bwrap exits before running anything.

What the program sees: the read-only system (/usr and the /bin, /lib symlinks), a few read-only
/etc files (loader cache, alternatives, and a synthesised passwd/group/hosts), the real Python
prefix read-only, fresh /dev and /proc, size-capped private tmpfs /tmp and /dev/shm, its workspace
at /work (read-write, the cwd) and a read-only root. Nothing else of the host exists in its mount
namespace. It has its own pid, ipc, uts, cgroup and (unless `spec.network`) network namespace.
Small /etc files are copied into the (then read-only) root rather than bind-mounted: bwrap re-reads
the whole mount table for every bind, which made binds a large part of an exec's cost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import signal
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rlfleet.sandbox.cgroups import ExecCgroup
from rlfleet.sandbox.driver import SandboxSpec
from rlfleet.sandbox.errors import SandboxDriverUnavailable
from rlfleet.sandbox.limits import rlimits
from rlfleet.sandbox.seccomp import ALLOW_ALL, sandbox_filter
from rlfleet.sandbox.workspace import SANDBOX_USER, Slot

SETPRIV = "/usr/bin/setpriv"
# tini as the sandbox's pid 1 (bwrap --as-pid-1): it reaps orphans and, unlike bwrap's own init,
# is waited for by bwrap, so the kernel's rusage of the whole tree reaches the driver (bwrap's
# init reports the exit through an eventfd and is never reaped by bwrap: its CPU time is lost).
# The static build (same package) when present: no dynamic loading, about half a millisecond less.
TINI_CANDIDATES = ("/usr/bin/tini-static", "/usr/bin/tini")
_SYSTEM_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
# Host /etc entries shown read-only: directories are bound; files are copied in (see above).
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime")
_ETC_NETWORK = ("resolv.conf", "ssl", "ca-certificates", "gai.conf", "host.conf")
_ETC_GENERATED = ("passwd", "group", "hosts", "nsswitch.conf")
# Only SETUID/SETGID (the uid switch) and SETPCAP (clearing the bounding set) survive into the
# sandbox's root phase, and setpriv drops them before the program runs.
_CAPS = [
    "--cap-drop",
    "ALL",
    "--cap-add",
    "CAP_SETUID",
    "--cap-add",
    "CAP_SETGID",
    "--cap-add",
    "CAP_SETPCAP",
]
# The environment of bwrap itself (not of the sandbox, which starts from --clearenv).
HOST_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C"}
# Copied files bigger than this are bound instead (the copy is per exec).
_MAX_COPY_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Sandboxing:
    """What is the same for every exec on this host: tools and the system mounts."""

    bwrap: str
    tini: str | None
    system_args: tuple[str, ...]
    etc_copies: tuple[str, ...]  # host /etc files copied into each sandbox (the rest are bound)
    path_env: str
    seccomp: bytes | None  # the filter program, None where unsupported

    @classmethod
    def for_host(
        cls,
        *,
        bwrap: str,
        tini: str | None,
        python_prefix: str,
        extra_ro_binds: tuple[str, ...],
        tmp_size_bytes: int,
    ) -> Sandboxing:
        args, copies, path = _system_mounts(python_prefix, extra_ro_binds, tmp_size_bytes)
        return cls(bwrap, tini, tuple(args), tuple(copies), path, sandbox_filter())

    def base_env(self) -> dict[str, str]:
        return {
            "PATH": self.path_env,
            "HOME": "/work",
            "USER": SANDBOX_USER,
            "LOGNAME": SANDBOX_USER,
            "SHELL": "/bin/sh",
            "LANG": "C.UTF-8",
            "TMPDIR": "/tmp",
            # Keep the workspace what the program made: no __pycache__ for the verifier to see.
            "PYTHONDONTWRITEBYTECODE": "1",
        }

    def gate(self, spec: SandboxSpec, exec_cg: ExecCgroup | None) -> ExecGate:
        """The gate of one exec: its filter, its rlimits and its cgroup (see the module doc)."""
        # With a pids cgroup, RLIMIT_NPROC gets one task of slack so that pids.max (which counts
        # refused forks) is the limit actually hit; without one, NPROC is exact.
        extra = self.init_tasks() + (1 if exec_cg else 0)
        limits = rlimits(spec.limits, limit_address_space=exec_cg is None, extra_tasks=extra)
        return ExecGate(self.seccomp or ALLOW_ALL, limits, exec_cg)

    def init_tasks(self) -> int:
        """Tasks of the sandbox's uid besides the program's own (tini)."""
        return 1 if self.tini else 0

    def open_etc(self, slot: Slot, max_file_bytes: int) -> tuple[list[str], list[int]]:
        """Per-exec /etc files: (bwrap arguments, the fds they name, which the caller closes once
        bwrap has started). Copied from fds opened now, so each exec sees the current files.

        The exec's rlimits may already be on bwrap's sandbox process while it copies (the gate
        only holds back the exec, not the setup before it), so a file bigger than the exec's
        RLIMIT_FSIZE is bound instead: the copy would fail."""
        max_copy = min(_MAX_COPY_BYTES, max_file_bytes)
        args: list[str] = []
        fds: list[int] = []
        sources = [(f"/etc/{n}", f"/etc/{n}", True) for n in self.etc_copies]
        sources += [(str(slot.etc / n), f"/etc/{n}", False) for n in _ETC_GENERATED]
        try:
            for src, dest, optional in sources:
                try:
                    fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
                except FileNotFoundError:
                    if optional:
                        continue  # as --ro-bind-try would
                    raise
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_size > max_copy:
                    os.close(fd)
                    args += ["--ro-bind-try" if optional else "--ro-bind", src, dest]
                    continue
                fds.append(fd)
                args += ["--perms", "0644", "--file", str(fd), dest]
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return args, fds

    def command(
        self,
        slot: Slot,
        spec: SandboxSpec,
        argv: list[str],
        *,
        env: Mapping[str, str],
        cwd: str,
        status_fd: int | None,
        gate_fd: int,
        etc_args: list[str],
    ) -> list[str]:
        a = [self.bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try"]
        if self.tini:
            a.append("--as-pid-1")
        if not spec.network:
            a.append("--unshare-net")
        a += ["--die-with-parent", "--new-session", "--hostname", "sandbox", *_CAPS, *self.system_args]
        if spec.network:
            for name in _ETC_NETWORK:
                a += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        a += etc_args
        a += ["--bind", str(slot.work), "/work", "--remount-ro", "/", "--chdir", f"/work/{cwd}".rstrip("/")]
        a.append("--clearenv")
        for key, value in env.items():
            a += ["--setenv", key, value]
        if status_fd is not None:
            a += ["--json-status-fd", str(status_fd)]
        a += ["--seccomp", str(gate_fd)]
        a += ["--", SETPRIV, "--reuid", str(slot.uid), "--regid", str(slot.uid), "--clear-groups"]
        a += ["--inh-caps=-all", "--bounding-set=-all", "--nnp", "--"]
        if self.tini:
            a += [self.tini, "--"]
        a += argv
        return a


class ExecGate:
    """The pipe bwrap reads the exec's seccomp filter from, kept shut until the exec's limits are on.

    `on_status` (fed bwrap's status output as it arrives) finds bwrap's sandbox process, which
    cannot have run anything yet: it is either setting up mounts or blocked reading this pipe (so
    the limits may apply to the rest of its setup too: see `Sandboxing.open_etc`). A worker thread
    then moves that process into the exec's cgroup (a v1 memory-cgroup move sleeps for ms; the
    event loop must not), sets its rlimits, writes the filter and closes the pipe. Closing the gate
    any other way (`close`, or the driver dying) ends the pipe empty, and bwrap exits on the empty
    filter without exec'ing.
    """

    def __init__(
        self, program: bytes, limits: list[tuple[int, tuple[int, int]]], exec_cg: ExecCgroup | None
    ) -> None:
        self._program, self._limits, self._cg = program, limits, exec_cg
        self.read_fd, self._write_fd = os.pipe()  # non-inheritable; pass read_fd to bwrap
        self._lock = threading.Lock()
        self._opening: asyncio.Future[None] | None = None
        self.opened = False

    def on_status(self, bwrap_pid: int, status_data: bytes) -> bool | asyncio.Future[None]:
        """Start opening the gate once the sandbox process is known: False while it is not, else
        the future of the opening (failing if the limits could not be put on)."""
        if self._opening is not None:
            return self._opening
        pid = _child_pid(status_data)
        if pid is None:
            return False
        self._opening = asyncio.get_running_loop().run_in_executor(None, self._open, pid, bwrap_pid)
        return self._opening

    async def wait(self) -> None:
        """Until an opening started by `on_status` has finished (its error is raised elsewhere)."""
        if self._opening is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._opening)

    def _open(self, pid: int, bwrap_pid: int) -> None:
        with self._lock:
            if self._write_fd < 0:
                return
            pidfd = _open_child(pid, bwrap_pid)
            if pidfd is None:  # already gone: bwrap reports why
                self._close()
                return
            try:
                if self._cg is not None:
                    self._cg.add(pid)
                for res, limit in self._limits:
                    resource.prlimit(pid, res, limit)
                # Under PIPE_BUF: one atomic write, so bwrap reads the whole filter or nothing.
                os.write(self._write_fd, self._program)
                self.opened = True
            except (ProcessLookupError, BrokenPipeError):  # it died meanwhile (killed at a deadline)
                pass
            except OSError as e:
                raise SandboxDriverUnavailable(
                    f"could not put the exec's limits on the sandbox process: {e}",
                    reason="sandbox_setup_failed",
                ) from e
            finally:
                os.close(pidfd)
                self._close()

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        for name in ("read_fd", "_write_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                setattr(self, name, -1)
                with contextlib.suppress(OSError):
                    os.close(fd)


def _system_mounts(
    python_prefix: str, extra_ro_binds: tuple[str, ...], tmp_size_bytes: int
) -> tuple[list[str], list[str], str]:
    """Mount arguments shared by every exec, the /etc files to copy per exec, and the sandbox's PATH."""
    a = ["--ro-bind", "/usr", "/usr"]
    for name in _SYSTEM_LINKS:  # merged-/usr hosts make these symlinks; mirror whatever they are
        host = f"/{name}"
        if os.path.islink(host):
            a += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            a += ["--ro-bind", host, host]
    a += ["--perms", "0755", "--dir", "/etc"]
    copies = []
    for name in _ETC:
        if os.path.isdir(f"/etc/{name}"):
            a += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        else:
            copies.append(name)
    made: set[str] = {"/", "/usr", "/etc"}
    for host in [python_prefix, *(os.path.realpath(p) for p in extra_ro_binds)]:
        if _under_usr(host):
            continue
        # Parents are created world-traversable: /root is 0700 on the host, and a bind's parent
        # directories would otherwise hide the prefix from the sandbox's unprivileged uid.
        for parent in reversed([str(p) for p in Path(host).parents]):
            if parent not in made:
                a += ["--perms", "0755", "--dir", parent]
                made.add(parent)
        a += ["--ro-bind", host, host]
        made.add(host)
    a += ["--dev", "/dev", "--proc", "/proc"]
    size = str(tmp_size_bytes)
    a += ["--perms", "1777", "--size", size, "--tmpfs", "/tmp"]
    a += ["--perms", "1777", "--size", size, "--tmpfs", "/dev/shm"]
    path = "/usr/local/bin:/usr/bin:/bin"
    if not _under_usr(python_prefix):
        path = f"{python_prefix}/bin:{path}"  # `python3` is the real interpreter, first on PATH
    return a, copies, path


def _under_usr(path: str) -> bool:
    return path == "/usr" or path.startswith("/usr/")


def status_messages(status_data: bytes) -> list[dict]:
    """The JSON objects bwrap wrote on its status fd (a stream of them, possibly incomplete)."""
    decoder, text, i, out = json.JSONDecoder(), status_data.decode(errors="replace"), 0, []
    while i < len(text):
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            break
        try:
            obj, i = decoder.raw_decode(text, i)
        except ValueError:
            break
        if isinstance(obj, dict):
            out.append(obj)
    return out


def bwrap_reported_exit(status_data: bytes) -> bool:
    """bwrap writes {"exit-code": N} on its status fd only if the sandbox ran; a setup failure
    (bad bind, missing cwd) exits 1 without it, which must not pass for the program's exit."""
    return any("exit-code" in m for m in status_messages(status_data))


def _child_pid(status_data: bytes) -> int | None:
    """The pid of bwrap's sandbox process (pid 1 of the sandbox), once bwrap has reported it."""
    messages = status_messages(status_data)
    return next((m["child-pid"] for m in messages if isinstance(m.get("child-pid"), int)), None)


def _open_child(pid: int, parent: int) -> int | None:
    """A pidfd for `pid` if it is still a child of `parent` (so not a recycled pid), else None."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            ppid = next((int(line.split()[1]) for line in f if line.startswith("PPid:")), None)
    except OSError:
        ppid = None
    if ppid != parent:
        os.close(pidfd)
        return None
    return pidfd


def kill_sandbox_init(bwrap_pid: int, status_data: bytes) -> bool:
    """SIGKILL the sandbox's pid 1, which takes its whole pid namespace down with it.

    Killing bwrap instead would orphan pid 1: a parent-death signal cannot reach it, because
    bwrap's monitor holds no capabilities and pid 1 runs as another uid. Killing pid 1 lets bwrap
    reap it and exit normally. The pid is pinned with a pidfd and checked to still be bwrap's
    child, so a recycled pid is never signalled.
    """
    pid = _child_pid(status_data)
    if pid is None:
        return False
    pidfd = _open_child(pid, bwrap_pid)
    if pidfd is None:
        return False
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        return True
    except OSError:
        return False
    finally:
        os.close(pidfd)
