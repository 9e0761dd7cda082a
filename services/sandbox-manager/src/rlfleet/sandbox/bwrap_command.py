"""The command line of one sandboxed exec, and reading back what bwrap reports about it.

    [sh: join the exec's cgroup] bwrap <namespaces, mounts> prlimit <rlimits> setpriv <drop uid> tini argv

bwrap is started by root *without* a user namespace: as root it can bind anything (the Python
prefix may live under root-only /root), and the uid switch after it makes the program a real
unprivileged uid on the host, which is what RLIMIT_NPROC and file permissions act on. (In a user
namespace created by root, the sandbox's uid would map to host root and NPROC would not apply.)
Only util-linux's prlimit and setpriv run as root inside, with every capability but
SETUID/SETGID/SETPCAP already dropped by bwrap; setpriv drops those too, clears the bounding set
and sets no_new_privs before exec'ing tini, then the program.

What the program sees: the read-only system (/usr and the /bin, /lib symlinks), a few read-only
/etc files (loader cache, alternatives, and a synthesised passwd/group/hosts), the real Python
prefix read-only, fresh /dev and /proc, size-capped private tmpfs /tmp and /dev/shm, its workspace
at /work (read-write, the cwd) and a read-only root. Nothing else of the host exists in its mount
namespace. It has its own pid, ipc, uts, cgroup and (unless `spec.network`) network namespace.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rlfleet.sandbox.cgroups import ExecCgroup
from rlfleet.sandbox.driver import SandboxSpec
from rlfleet.sandbox.limits import prlimit_args
from rlfleet.sandbox.seccomp import sandbox_filter
from rlfleet.sandbox.workspace import SANDBOX_USER, Slot

PRLIMIT = "/usr/bin/prlimit"
SETPRIV = "/usr/bin/setpriv"
# tini as the sandbox's pid 1 (bwrap --as-pid-1): it reaps orphans and, unlike bwrap's own init,
# is waited for by bwrap, so the kernel's rusage of the whole tree reaches the driver (bwrap's
# init reports the exit through an eventfd and is never reaped by bwrap: its CPU time is lost).
TINI = "/usr/bin/tini"
_SYSTEM_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
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
# Joins the cgroups whose cgroup.procs files are given, then becomes bwrap: everything bwrap
# starts is accounted from its first instruction on.
_JOIN_CGROUPS = (
    'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n-1)); done; exec "$@"'
)


@dataclass(frozen=True, slots=True)
class Sandboxing:
    """What is the same for every exec on this host: tools and the system mounts."""

    bwrap: str
    tini: str | None
    system_args: tuple[str, ...]
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
        args, path = _system_mounts(python_prefix, extra_ro_binds, tmp_size_bytes)
        return cls(bwrap, tini, tuple(args), path, sandbox_filter())

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

    def seccomp_fd(self) -> int | None:
        """A fresh fd holding the filter for one exec (bwrap reads it from the start), or None."""
        if self.seccomp is None:
            return None
        fd = os.memfd_create("rlfleet-seccomp", os.MFD_CLOEXEC)
        os.write(fd, self.seccomp)
        os.lseek(fd, 0, os.SEEK_SET)
        return fd

    def init_tasks(self) -> int:
        """Tasks of the sandbox's uid besides the program's own (tini)."""
        return 1 if self.tini else 0

    def command(
        self,
        slot: Slot,
        spec: SandboxSpec,
        argv: list[str],
        *,
        env: Mapping[str, str],
        cwd: str,
        status_fd: int | None,
        seccomp_fd: int | None,
        exec_cg: ExecCgroup | None,
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
        for name in _ETC_GENERATED:
            a += ["--ro-bind", str(slot.etc / name), f"/etc/{name}"]
        a += ["--bind", str(slot.work), "/work", "--remount-ro", "/", "--chdir", f"/work/{cwd}".rstrip("/")]
        a.append("--clearenv")
        for key, value in env.items():
            a += ["--setenv", key, value]
        a += ["--json-status-fd", str(status_fd)]
        if seccomp_fd is not None:
            a += ["--seccomp", str(seccomp_fd)]
        # With a pids cgroup, RLIMIT_NPROC gets one task of slack so that pids.max (which counts
        # refused forks) is the limit actually hit; without one, NPROC is exact.
        extra = self.init_tasks() + (1 if exec_cg else 0)
        a += [
            "--",
            PRLIMIT,
            *prlimit_args(spec.limits, limit_address_space=exec_cg is None, extra_tasks=extra),
        ]
        a += ["--", SETPRIV, "--reuid", str(slot.uid), "--regid", str(slot.uid), "--clear-groups"]
        a += ["--inh-caps=-all", "--bounding-set=-all", "--nnp", "--"]
        if self.tini:
            a += [self.tini, "--"]
        a += argv
        if exec_cg is not None:
            procs = exec_cg.procs_files
            a = ["/bin/sh", "-c", _JOIN_CGROUPS, "sh", str(len(procs)), *procs, *a]
        return a


def _system_mounts(
    python_prefix: str, extra_ro_binds: tuple[str, ...], tmp_size_bytes: int
) -> tuple[list[str], str]:
    """Mount arguments shared by every exec, and the sandbox's PATH."""
    a = ["--ro-bind", "/usr", "/usr"]
    for name in _SYSTEM_LINKS:  # merged-/usr hosts make these symlinks; mirror whatever they are
        host = f"/{name}"
        if os.path.islink(host):
            a += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            a += ["--ro-bind", host, host]
    a += ["--perms", "0755", "--dir", "/etc"]
    for name in _ETC:
        a += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
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
    return a, path


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


def kill_sandbox_init(bwrap_pid: int, status_data: bytes) -> bool:
    """SIGKILL the sandbox's pid 1, which takes its whole pid namespace down with it.

    Killing bwrap instead would orphan pid 1: a parent-death signal cannot reach it, because
    bwrap's monitor holds no capabilities and pid 1 runs as another uid. Killing pid 1 lets bwrap
    reap it and exit normally. The pid is pinned with a pidfd and checked to still be bwrap's
    child, so a recycled pid is never signalled.
    """
    messages = status_messages(status_data)
    pid = next((m["child-pid"] for m in messages if isinstance(m.get("child-pid"), int)), None)
    if pid is None:
        return False
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        with open(f"/proc/{pid}/status") as f:
            ppid = next((int(line.split()[1]) for line in f if line.startswith("PPid:")), None)
        if ppid != bwrap_pid:
            return False
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        return True
    except OSError:
        return False
    finally:
        os.close(pidfd)
