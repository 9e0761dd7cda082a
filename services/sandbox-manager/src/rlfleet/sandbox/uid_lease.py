"""Host-wide leases of sandbox uid ranges, so that managers sharing a host never share (or kill) uids.

Every driver on a host leases the uid range its sandboxes run as from one directory that all of
them see (`driver.uid_lease_dir`, by default under /run, which a reboot clears together with every
process the leases protected):

    <dir>/.lock                       flock'd while a driver inspects or changes the leases
    <dir>/<first>-<count>.lease       one per leased range; JSON {pid, host, root, first, count, since}

A lease is held by an exclusive flock on its file, taken by the holder and kept for its lifetime
(the fd is close-on-exec, so no sandbox inherits it). The kernel drops a flock when its holder
dies, however it dies, so a lease whose flock can be taken is stale: its holder is gone, and the
lease is removed and the range may be leased again. The recorded pid is for messages and for
operators; liveness is the lock itself, which, unlike a pid, cannot be recycled and works across
pid namespaces that share the directory.

A range is either pinned (`uid_base`: lease exactly that, or fail naming the holder) or picked:
the range this driver's root used last time (so a restarted driver meets, and clears, what its
predecessor left), else the lowest free range in the search window in which no process is
running, so a driver never adopts uids some other program is using.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rlfleet.sandbox.errors import SandboxDriverUnavailable

_REGISTRY_LOCK = ".lock"
_SUFFIX = ".lease"


@dataclass(frozen=True, slots=True, order=True)  # ordered by first uid: picking sorts the leases held
class UidRange:
    first: int
    count: int

    @property
    def end(self) -> int:
        return self.first + self.count

    def overlaps(self, other: UidRange) -> bool:
        return self.first < other.end and other.first < self.end

    def __contains__(self, uid: int) -> bool:
        return self.first <= uid < self.end

    def file_name(self) -> str:
        return f"{self.first}-{self.count}{_SUFFIX}"

    @classmethod
    def from_file_name(cls, name: str) -> UidRange | None:
        if not name.endswith(_SUFFIX):
            return None
        first, _, count = name[: -len(_SUFFIX)].partition("-")
        if not (first.isdigit() and count.isdigit()):
            return None
        return cls(int(first), int(count))


class UidLease:
    """A uid range this process holds on the host until `release` (or until it dies)."""

    def __init__(self, directory: Path, uids: UidRange, fd: int) -> None:
        self.directory, self.uids = directory, uids
        self._fd: int | None = fd  # None once released

    @property
    def path(self) -> Path:
        return self.directory / self.uids.file_name()

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Give the range back: the file goes first, while it is still locked, so no one can
        mistake it for a stale lease of a range someone is about to reuse."""
        if self._fd is None:
            return
        with _registry(self.directory):
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            os.close(self._fd)
            self._fd = None


def lease_uid_range(
    directory: Path,
    count: int,
    *,
    pinned: int | None,
    search_from: int,
    search_to: int,
    preferred: int | None = None,
    root: str = "",
) -> UidLease:
    """Lease `count` uids host-wide: `pinned` exactly, else `preferred` if free, else the lowest
    free range in [search_from, search_to) with no process running under it."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    with _registry(directory):
        held = _live_leases(directory)
        if pinned is not None:
            wanted = UidRange(pinned, count)
            holder = next((h for h in held if h[0].overlaps(wanted)), None)
            if holder is not None:
                raise SandboxDriverUnavailable(
                    f"uids {wanted.first}..{wanted.end - 1} overlap the range "
                    f"{holder[0].first}..{holder[0].end - 1} "
                    f"leased by pid {holder[1].get('pid')} (root {holder[1].get('root')!r}) in {directory}; "
                    "pin another driver.uid_base or leave it unset to pick a free range",
                    reason="uid_range_in_use",
                    uid_base=wanted.first,
                    holder_pid=holder[1].get("pid"),
                )
        else:
            wanted = _pick(held, count, search_from, search_to, preferred)
        return _take(directory, wanted, root)


def _pick(
    held: list[tuple[UidRange, dict]], count: int, search_from: int, search_to: int, preferred: int | None
) -> UidRange:
    taken = sorted(r for r, _ in held)
    if preferred is not None:
        candidate = UidRange(preferred, count)
        if (search_from <= preferred and candidate.end <= search_to
                and not any(r.overlaps(candidate) for r in taken)):
            return candidate  # this root's own range: what is running there is its predecessor's
    busy = _process_uids()
    first = search_from
    while first + count <= search_to:
        candidate = UidRange(first, count)
        blocking = [r for r in taken if r.overlaps(candidate)]
        if blocking:
            first = max(r.end for r in blocking)
            continue
        running = [u for u in busy if u in candidate]
        if running:
            first = max(running) + 1
            continue
        return candidate
    raise SandboxDriverUnavailable(
        f"no free range of {count} uids in [{search_from}, {search_to}): {len(taken)} leased, "
        f"{len(busy)} other uids running",
        reason="no_free_uid_range",
        count=count,
    )


def _take(directory: Path, uids: UidRange, root: str) -> UidLease:
    path = directory / uids.file_name()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: the registry lock vetted this range
        record = {"pid": os.getpid(), "host": socket.gethostname(), "root": root,
                  "first": uids.first, "count": uids.count, "since": time.time()}
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(record).encode())
    except BaseException:
        os.close(fd)
        raise
    return UidLease(directory, uids, fd)


def _live_leases(directory: Path) -> list[tuple[UidRange, dict]]:
    """Ranges whose holder still holds their lock; stale lease files are removed on the way."""
    live = []
    for entry in os.scandir(directory):
        uids = UidRange.from_file_name(entry.name)
        if uids is None:
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # its holder is alive
                live.append((uids, _record(fd)))
                continue
            # Nobody holds it: the holder died without releasing (kill -9, crash, OOM).
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
        finally:
            os.close(fd)
    return live


def _record(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        record = json.loads(data)
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        return {}


def live_leases(directory: Path) -> list[tuple[UidRange, dict]]:
    """Every live lease in `directory` (for operators and tests)."""
    if not directory.is_dir():
        return []
    with _registry(directory):
        return _live_leases(directory)


@contextlib.contextmanager
def _registry(directory: Path) -> Iterator[None]:
    fd = os.open(directory / _REGISTRY_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held for a scan of a small directory
        yield
    finally:
        os.close(fd)


def _process_uids() -> set[int]:
    uids = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                uids.add(entry.stat().st_uid)
    return uids
