"""Sandbox slots on the host: a directory, an unprivileged uid, optionally a cgroup.

Layout under the driver's root (mode 0700, root-owned, so no sandbox uid can even traverse it):

    <root>/<id>/work   the workspace: a tmpfs of its own (size and inode quotas), owned by the
                       slot's uid, bound read-write at /work
    <root>/<id>/etc    passwd/group/hosts/nsswitch.conf for the sandbox, bound read-only

Each live sandbox has its own uid (uid_base + k). That makes RLIMIT_NPROC, which the kernel counts
per real uid, a per-sandbox process limit, and keeps sandboxes apart at the permission level too.
Uids are handed out first-in first-out, so a uid is reused as late as possible.

Each workspace is a size- and inode-limited tmpfs mounted by the driver (nosuid, nodev): a program
that writes past `workspace_bytes` or `workspace_inodes` gets ENOSPC, and nothing it writes reaches
the host's disk (where Redis, JetStream and the weight store live). Its contents are memory: where
the driver has memory cgroups, what a program writes there is charged to its sandbox's cgroup, so
it counts toward `memory_bytes` for as long as it stays. Removing a slot unmounts the tmpfs, which
frees every file at once (no unlink per file).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import secrets
import shutil
import signal
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from rlfleet.sandbox.cgroups import CgroupSupport, SandboxCgroup
from rlfleet.sandbox.errors import SandboxCapacityExhausted, SandboxDriverUnavailable

SANDBOX_USER = "sandbox"
WORKSPACE_FS = "rlfleet-workspace"  # the tmpfs' source name, as /proc/self/mountinfo shows it
_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2
_libc = ctypes.CDLL(None, use_errno=True)
LOCK_NAME = ".driver.lock"
UID_RANGE_NAME = ".uid_range"  # the uid range this root's driver leased last: "first count"


@dataclass(frozen=True, slots=True)
class WorkspaceQuota:
    bytes: int
    inodes: int  # files, directories and symlinks, the workspace's root included


@dataclass(slots=True)
class Slot:
    id: str
    dir: Path
    uid: int
    cgroup: SandboxCgroup | None

    @property
    def work(self) -> Path:
        return self.dir / "work"

    @property
    def etc(self) -> Path:
        return self.dir / "etc"


class UidAllocator:
    def __init__(self, base: int, count: int) -> None:
        if base < 1000 or count < 1 or base + count > 2**31:
            raise ValueError(f"bad uid range {base}+{count}")
        self.capacity = count
        self._free = deque(range(base, base + count))

    def take(self) -> int:
        if not self._free:
            raise SandboxCapacityExhausted(
                f"all {self.capacity} sandbox slots are in use", capacity=self.capacity
            )
        return self._free.popleft()

    def give_back(self, uid: int) -> None:
        self._free.append(uid)


def prepare_slot(root: Path, uids: UidAllocator, cgroups: CgroupSupport | None,
                 quota: WorkspaceQuota) -> Slot:
    """Make an empty sandbox (its workspace tmpfs, its cgroup). Synchronous: a handful of syscalls."""
    uid = uids.take()
    slot = Slot(secrets.token_hex(8), Path(), uid, None)
    slot.dir = root / slot.id
    try:
        slot.dir.mkdir(mode=0o700)
        slot.work.mkdir(mode=0o755)
        mount_workspace(slot.work, quota, uid)
        slot.etc.mkdir(mode=0o755)
        _write_etc(slot.etc, uid)
        if cgroups is not None and cgroups.available:
            slot.cgroup = cgroups.create(f"sbx-{slot.id}")
    except BaseException:
        remove_slot(slot, uids)
        raise
    return slot


def _write_etc(etc: Path, uid: int) -> None:
    # Synthesised, not the host's: the host's passwd/group name real accounts (and /etc/shadow
    # must never be reachable). getpwuid() working keeps tools like `id`, pip and git happy.
    (etc / "passwd").write_text(
        f"root:x:0:0:root:/root:/usr/sbin/nologin\n{SANDBOX_USER}:x:{uid}:{uid}:sandbox:/work:/bin/sh\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    )
    (etc / "group").write_text(f"root:x:0:\n{SANDBOX_USER}:x:{uid}:\nnogroup:x:65534:\n")
    (etc / "hosts").write_text("127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n")
    (etc / "nsswitch.conf").write_text("passwd: files\ngroup: files\nhosts: files dns\n")
    for f in etc.iterdir():
        f.chmod(0o644)


def kill_uid_processes(first_uid: int, count: int = 1) -> int:
    """SIGKILL every process running as a uid in [first_uid, first_uid + count).

    Nothing should be: each exec's pid namespace dies with it. This is the backstop that keeps a
    reused uid from meeting an earlier episode, and that clears what a crashed driver left."""
    killed = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if first_uid <= entry.stat().st_uid < first_uid + count:
                    os.kill(int(entry.name), signal.SIGKILL)
                    killed += 1
    return killed


def mount_workspace(target: Path, quota: WorkspaceQuota, uid: int) -> None:
    options = f"size={quota.bytes},nr_inodes={quota.inodes},mode=0755,uid={uid},gid={uid}"
    if _libc.mount(WORKSPACE_FS.encode(), str(target).encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV,
                   options.encode()) != 0:
        e = ctypes.get_errno()
        raise SandboxDriverUnavailable(f"could not mount the workspace tmpfs on {target}: {os.strerror(e)}",
                                       reason="workspace_mount_failed", errno=e)


def unmount(target: Path) -> None:
    """Detach a mount (lazily: anything still holding it lets go on its own); not mounted is fine."""
    if _libc.umount2(str(target).encode(), _MNT_DETACH) != 0:
        e = ctypes.get_errno()
        if e not in (errno.EINVAL, errno.ENOENT):
            raise OSError(e, os.strerror(e), str(target))


def mounts_under(root: Path) -> list[Path]:
    """Mount points at or below `root` in this mount namespace, deepest first."""
    prefix = str(root.resolve()).rstrip("/") + "/"
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
            if point.startswith(prefix):
                found.append(Path(point))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def workspace_full(work: Path) -> tuple[bool, bool]:
    """(no bytes left, no inodes left) in a workspace tmpfs: the program ran into its quota."""
    try:
        st = os.statvfs(work)
    except OSError:
        return False, False
    return st.f_bavail == 0, st.f_favail == 0


def remove_slot(slot: Slot, uids: UidAllocator) -> None:
    """Delete everything of the slot and free its uid. rmtree does not follow symlinks the
    sandbox planted (it works on fds; `shutil.rmtree.avoids_symlink_attacks` holds on Linux)."""
    if slot.cgroup is not None:
        slot.cgroup.kill_all()
    kill_uid_processes(slot.uid)
    # Unmounted before the cgroup goes: the workspace's pages are charged to it, and freeing them
    # first lets the cgroup be removed outright instead of lingering as a dying one.
    unmount(slot.work)
    if slot.cgroup is not None:
        slot.cgroup.remove()
    if slot.dir.exists():
        shutil.rmtree(slot.dir)
    uids.give_back(slot.uid)


def sweep_root(root: Path) -> int:
    """Delete leftovers of a driver that died without cleaning up (we hold the root's lock)."""
    for point in mounts_under(root):  # its workspace tmpfs mounts, when it shared our mount namespace
        unmount(point)
    removed = 0
    for entry in root.iterdir():
        if entry.name in (LOCK_NAME, UID_RANGE_NAME):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
        removed += 1
    return removed
