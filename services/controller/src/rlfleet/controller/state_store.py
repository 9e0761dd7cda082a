"""The run's state in the platform's own store, so a controller started anywhere continues the run.

Why JetStream KV and not Redis: the controller already talks to the run's NATS with a user of its
own, and never to Redis. JetStream keeps a bucket as it keeps the run's streams: a file store, on
the NATS volume in compose and Kubernetes and under the run directory locally, replicated across
a NATS cluster (`state.replicas`; the gpu-cluster overlay's three servers), where the Kubernetes
Redis is one pod whose append-only file is fsynced once a second. A KV update can be made
conditional on the key's revision (`Nats-Expected-Last-Subject-Sequence`), which is the
compare-and-set the guard below needs, with no script; and NATS's subject permissions scope the
bucket per run exactly as they scope the streams (rlfleet.common.infra_auth: only the controller
may create the bucket or read and write its run's keys).

Keys of the bucket `RLFLEET_RUNS`, for run `<run>`:

    <run>.head                the head: generation, where the state's parts are and their checksum,
                              the state's status, the controller holding the run and its lease
    <run>.<owner>.<a|b>.<i>   the state: a `RunState` as JSON, zlib-compressed, in parts of at most
                              `state.part_bytes` (512 KiB: under NATS's default 1 MB message limit)

Size: nothing is dropped from the record (the report is made from it). It is compressed (zlib
level 1: a synthetic record of `make run`'s size, 61 steps of 64 trajectories and episodes and 13
gate evaluations of 200 tasks with random values, is 2.6 MB of JSON and 0.59 MB stored; ten times
that run, 5.8 MB in 12 parts) and split into parts, so it may grow past any message limit. The cost
is the one the run-directory file had, the whole state serialized at every save (every 10 s and at
each gate decision); level 1 compresses about 4x faster than zlib's default for 15% more bytes.

A save is atomic: the parts go to the owner's slot that the current head does not point to, then
the head is swapped with an update conditional on the revision just read; a reader that raced a
save (a checksum mismatch) reads the head again. A controller killed between the two leaves the
previous generation whole.

The guard: a controller claims the run with that same conditional update (the read it decided on
is the revision it expects) and renews its lease in the head every third of `state.lease_s`.
Another controller refuses the run (`RunHeld`, naming the holder) while the head says running and
the holder's lease is live, unless the holder is a process on the same machine (host, boot and PID
namespace) that is gone, which is how the local launcher's restart after a crash continues at once;
a controller on another machine, or in another container (a restarted container has a new PID
namespace), waits for the lease to lapse (`resume_on_start`). An orderly stop saves the run as
stopped, which holds no lease. A controller whose head was taken
over (its update refused, the head naming another holder) raises `RunTakenOver` on its next save
or renewal and stops driving: it never hands out tasks beside the new holder for longer than a
third of its lease. Leases compare wall clocks of different machines: keep them in sync (NTP).

The run directory: after each save the same state is written to `run_state.json` (`state.mirror`),
which `rlfleet run` reads before its platform is up (to refuse or resume) and `rlfleet status`
shows stop rules from. A run directory from before this store (only `run_state.json`, the bucket
never held the run) is read once, and the claim puts it in the store.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NoReturn, TypeVar

import nats.errors
import nats.js.errors
from nats.js.api import KeyValueConfig, StorageType
from nats.js.client import JetStreamContext
from nats.js.kv import KeyValue

from rlfleet.cli.launcher import start_ticks
from rlfleet.cli.run_state import STATE_FILE, RunState, driver_alive, host_identity
from rlfleet.common.errors import FailedPrecondition, StartupError, Unavailable
from rlfleet.common.infra_auth import RUN_STATE_BUCKET
from rlfleet.controller.config import RunStoreConfig
from rlfleet.controller.metrics import ControllerMetrics

log = logging.getLogger(__name__)
T = TypeVar("T")
SCHEMA = 1
READ_TRIES = 4  # a read that raced this many saves reports the state as damaged
ZLIB_LEVEL = 1  # fast: the state is written every 10 s on a busy CPU


# -- errors ---------------------------------------------------------------------------------------


class RunHeld(FailedPrecondition):
    """Another controller drives the run and its lease is live: this one does not."""

    def __init__(self, run_id: str, holder: Owner, lease_left_s: float, retry_after_s: float) -> None:
        super().__init__(f"run {run_id!r} is driven by another controller ({holder.describe()}), "
                         f"whose lease has {lease_left_s:.0f} s left; stop it there (StopRun), or wait: it "
                         "is taken over once that controller is gone or its lease lapsed", run_id=run_id,
                         holder=holder.id, holder_host=holder.hostname, holder_pid=holder.pid,
                         lease_left_s=round(lease_left_s, 1))
        self.retry_after_s = retry_after_s


class RunTakenOver(FailedPrecondition):
    """This controller's hold on the run was taken over (its lease had lapsed): it saves nothing
    more and stops driving."""

    def __init__(self, run_id: str, holder: Owner | None) -> None:
        by = holder.describe() if holder is not None else "nobody: its state was removed"
        super().__init__(f"run {run_id!r} was taken over by another controller ({by}); this one stops "
                         "driving it", run_id=run_id, holder=holder.id if holder else "")


class StateDamaged(FailedPrecondition):
    def __init__(self, message: str, revision: int = 0) -> None:
        super().__init__(message)
        self.revision = revision


class StateUnavailable(Unavailable):
    """NATS did not answer (a restart, an outage) within the time a store operation may take."""


class _Conflict(Exception):
    """The head's revision moved and the head names another holder (or none)."""

    def __init__(self, current: Head | None) -> None:
        super().__init__("the head changed")
        self.current = current


# -- what the store holds -------------------------------------------------------------------------


@dataclass(frozen=True)
class Owner:
    """A controller process: an id of its own (per store), its machine and PID namespace, PID and
    the PID's start time."""

    id: str
    host: str
    pid: int
    start: int

    @classmethod
    def this_process(cls) -> Owner:
        pid = os.getpid()
        return cls(uuid.uuid4().hex[:12], host_identity(), pid, start_ticks(pid) or 0)

    @property
    def hostname(self) -> str:
        return self.host.split("/", 1)[0]

    def alive(self) -> bool | None:
        """True or False on this machine; None when it runs elsewhere (only its lease tells)."""
        return driver_alive(self.pid, self.start, self.host)

    def describe(self) -> str:
        return f"controller {self.id}, pid {self.pid} on {self.hostname}"


@dataclass(frozen=True)
class Head:
    run_id: str
    generation: int
    owner: Owner
    slot: str                # key prefix of the state's parts: "<owner id>.<a|b>"
    parts: int
    size: int                # compressed bytes
    raw_size: int            # JSON bytes
    sha256: str              # of the compressed bytes
    status: str              # the state's: a lease holds only while it is "running"
    renewed_unix: float
    lease_s: float
    slots: dict[str, int] = field(default_factory=dict)  # parts in each of the owner's slots (to remove)
    schema: int = SCHEMA

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> Head:
        fields = json.loads(data)
        fields["owner"] = Owner(**fields["owner"])
        return cls(**fields)

    def lease_left_s(self, now: float) -> float:
        return self.renewed_unix + self.lease_s - now


@dataclass(frozen=True)
class Snapshot:
    """The run's state as read, and the head revision a claim made on it expects."""

    state: RunState | None
    head: Head | None
    revision: int            # 0: the key was never written
    where: str               # where the state was read from (for messages)
    damaged: str = ""        # why the stored state cannot be read (then `state` is None)


async def open_bucket(js: JetStreamContext, replicas: int) -> KeyValue:
    """The run-state bucket, created (file storage, one revision per key, direct gets) if missing."""
    try:
        return await js.key_value(RUN_STATE_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        pass
    config = KeyValueConfig(bucket=RUN_STATE_BUCKET, description="rlfleet runs' state (the controller's)",
                            history=1, storage=StorageType.FILE, replicas=replicas, direct=True)
    try:
        return await js.create_key_value(config)
    except nats.js.errors.BadRequestError:  # created meanwhile, by another controller
        return await js.key_value(RUN_STATE_BUCKET)


def transient(exc: BaseException) -> bool:
    """NATS restarting or unreachable: worth trying again (a refused update never is)."""
    if isinstance(exc, nats.js.errors.ServiceUnavailableError):
        return True
    if isinstance(exc, nats.js.errors.APIError):
        return False
    return isinstance(exc, TimeoutError | OSError | nats.errors.Error)


# -- the store ------------------------------------------------------------------------------------


class RunStore:
    """One run's state in JetStream KV, held by this controller once claimed (a `StateSink`)."""

    def __init__(self, kv: KeyValue, run_id: str, config: RunStoreConfig, mirror_dir: Path | None = None,
                 metrics: ControllerMetrics | None = None, owner: Owner | None = None) -> None:
        self.kv = kv
        self.run_id = run_id
        self.config = config
        self.mirror_dir = mirror_dir  # where run_state.json is written (and an older one read once)
        self.metrics = metrics
        self.owner = owner or Owner.this_process()
        self.claimed = False
        self.lost = ""  # why this controller no longer holds the run: it writes nothing more
        self.where = f"JetStream KV {RUN_STATE_BUCKET}, run {run_id}"
        self._lock = asyncio.Lock()  # one head write at a time (saves and renewals)

    @classmethod
    async def open(cls, js: JetStreamContext, run_id: str, config: RunStoreConfig,
                   mirror_dir: Path | None = None, metrics: ControllerMetrics | None = None) -> RunStore:
        kv = await retrying("opening the run-state bucket", lambda: open_bucket(js, config.replicas),
                            config.save_timeout_s)
        return cls(kv, run_id, config, mirror_dir, metrics)

    def key(self, *parts: str) -> str:
        return ".".join((self.run_id, *parts))

    # -- reading ----------------------------------------------------------------------------

    async def read(self) -> Snapshot:
        return await retrying("reading the run's state", self._read, self.config.save_timeout_s)

    async def _read(self) -> Snapshot:
        head, revision = None, 0
        for attempt in range(READ_TRIES):
            try:
                head, revision, deleted = await self._head()
            except StateDamaged as exc:
                return Snapshot(None, None, exc.revision, self.where, damaged=str(exc))
            if head is None:
                return self._from_run_dir(revision, deleted)
            data = await self._parts(head)
            if data is not None:
                try:
                    state = RunState.from_json(zlib.decompress(data), self.where)
                    return Snapshot(state, head, revision, self.where)
                except (zlib.error, StartupError) as exc:
                    return Snapshot(None, head, revision, self.where, damaged=str(exc))
            await asyncio.sleep(0.05 * (attempt + 1))  # a save replaced the parts meanwhile: read its head
        generation = head.generation if head is not None else 0
        return Snapshot(None, head, revision, self.where, damaged=f"{self.where}: the parts of generation "
                        f"{generation} do not match their checksum; start over with --fresh")

    async def _head(self) -> tuple[Head | None, int, bool]:
        """The head, its revision, and whether it was deleted (rather than never written)."""
        try:
            entry = await self.kv.get(self.key("head"))
        except nats.js.errors.KeyNotFoundError as exc:
            return None, (exc.entry.revision or 0) if exc.entry is not None else 0, exc.entry is not None
        revision = entry.revision or 0
        try:
            return Head.decode(entry.value or b""), revision, False
        except (ValueError, TypeError, KeyError) as exc:
            raise StateDamaged(f"{self.where}: its head is damaged ({exc}); start over with --fresh",
                               revision) from None

    async def _parts(self, head: Head) -> bytes | None:
        async def part(i: int) -> bytes | None:
            try:
                return (await self.kv.get(self.key(head.slot, str(i)))).value or b""
            except nats.js.errors.KeyNotFoundError:
                return None

        parts = await asyncio.gather(*(part(i) for i in range(head.parts)))
        if any(p is None for p in parts):
            return None
        data = b"".join(p for p in parts if p is not None)
        return data if hashlib.sha256(data).hexdigest() == head.sha256 else None

    def _from_run_dir(self, revision: int, deleted: bool) -> Snapshot:
        """No head: a run directory from before this store may hold the run (read once; the claim
        puts it in the store). Not after the head was deleted: that run was cleared."""
        path = self.mirror_dir / STATE_FILE if self.mirror_dir is not None else None
        if deleted or path is None or not path.exists():
            return Snapshot(None, None, revision, self.where)
        try:
            state = RunState.from_json(path.read_text(), str(path))
        except StartupError as exc:
            return Snapshot(None, None, revision, str(path), damaged=str(exc))
        if state.config.get("run_id", self.run_id) != self.run_id:
            log.warning("%s is run %s's, not %s's: not read", path, state.config.get("run_id"), self.run_id)
            return Snapshot(None, None, revision, self.where)
        log.info("the store has no state of run %s: read %s (the claim stores it)", self.run_id, path)
        return Snapshot(state, None, revision, str(path))

    # -- the guard --------------------------------------------------------------------------

    def check_free(self, snapshot: Snapshot) -> None:
        """Raises RunHeld while another live controller holds the run that `snapshot` shows."""
        head = snapshot.head
        if head is None or head.owner.id == self.owner.id or head.status != "running":
            return
        left = head.lease_left_s(time.time())
        alive = head.owner.alive()
        if left <= 0 or alive is False:
            return
        # On this machine the holder's end is seen at once; elsewhere, only when its lease lapses.
        raise RunHeld(self.run_id, head.owner, left, 1.0 if alive else left + 0.5)

    async def wait_until_free(self) -> None:
        """Returns once no live controller holds the run (reading only the head meanwhile)."""
        while True:
            head, revision, _ = await retrying("reading the run's head", self._head,
                                               self.config.save_timeout_s)
            try:
                self.check_free(Snapshot(None, head, revision, self.where))
                return
            except RunHeld as held:
                await asyncio.sleep(held.retry_after_s)

    async def claim(self, state: RunState, snapshot: Snapshot) -> None:
        """Takes the run with `state` as its first save, if the head is still the one `snapshot`
        read and no live controller holds it (RunHeld otherwise)."""
        text = state.to_json()
        async with self._lock:
            self.check_free(snapshot)

            tries = 0

            async def claim_once() -> None:
                nonlocal tries
                previous, revision = snapshot.head, snapshot.revision
                if tries:  # an earlier try may have gone through with its answer lost
                    current, now, _ = await self._head()
                    if now != revision:
                        if current is None or current.owner.id != self.owner.id:
                            raise _Conflict(current)
                        previous, revision = current, now
                tries += 1
                await self._write(text, state.status, previous, revision, claim=True)

            try:
                await retrying("claiming the run", claim_once, self.config.save_timeout_s)
            except _Conflict as exc:
                current = exc.current
                if current is not None:
                    left = current.lease_left_s(time.time())
                    raise RunHeld(self.run_id, current.owner, left, 1.0) from None
                raise FailedPrecondition(f"the state of run {self.run_id!r} changed while it was being "
                                         "claimed; try again", run_id=self.run_id) from None
            self.claimed, self.lost = True, ""
        self._mirror(state, text)

    # -- writing ----------------------------------------------------------------------------

    async def save(self, state: RunState) -> None:
        """Saves the run's state (RunTakenOver when another controller holds the run now)."""
        text = state.to_json()
        async with self._lock:
            try:
                await retrying("saving the run's state", lambda: self._save(text, state.status),
                               self.config.save_timeout_s)
            except StateUnavailable:
                self._count("unavailable")
                raise
        self._mirror(state, text)

    async def _save(self, text: str, status: str) -> None:
        previous, revision = await self._held_head()
        try:
            await self._write(text, status, previous, revision)
        except _Conflict as exc:
            self._lose(exc.current)

    async def renew(self) -> None:
        """Renews this controller's lease on the run (the head's time)."""
        async with self._lock:
            await retrying("renewing the lease", self._renew, self.config.lease_s / 3)

    async def _renew(self) -> None:
        current, revision = await self._held_head()
        if current.status != "running":
            return
        try:
            renewed = replace(current, renewed_unix=time.time(), lease_s=self.config.lease_s)
            await self._swap_head(renewed, revision)
        except _Conflict as exc:
            self._lose(exc.current)

    async def _held_head(self) -> tuple[Head, int]:
        """The current head, which must be this controller's."""
        if self.lost:
            raise RunTakenOver(self.run_id, None)
        if not self.claimed:
            raise FailedPrecondition(f"run {self.run_id!r} is not claimed by this controller",
                                     run_id=self.run_id)
        head, revision, _ = await self._head()
        if head is None or head.owner.id != self.owner.id:
            self._lose(head)
        return head, revision

    def _lose(self, holder: Head | None) -> NoReturn:
        error = RunTakenOver(self.run_id, holder.owner if holder is not None else None)
        self.lost = str(error)
        self._count("lost")
        log.error("%s", error)
        raise error

    async def _write(self, text: str, status: str, previous: Head | None, revision: int,
                     claim: bool = False) -> None:
        """The state's parts into the slot the current head does not use, then the head swapped. A
        claim then removes every other part the run had (a previous holder's, a previous run's)."""
        # Off the event loop (zlib frees the GIL): a state of megabytes takes a while.
        payload = await asyncio.to_thread(zlib.compress, text.encode(), ZLIB_LEVEL)
        size = self.config.part_bytes
        parts = [payload[i:i + size] for i in range(0, len(payload), size)] or [b""]
        mine = previous is not None and previous.owner.id == self.owner.id
        slot = f"{self.owner.id}.{'b' if mine and previous and previous.slot.endswith('.a') else 'a'}"
        await asyncio.gather(*(self.kv.put(self.key(slot, str(i)), part) for i, part in enumerate(parts)))
        before = dict(previous.slots) if previous is not None else {}
        shrunk = range(len(parts), before.get(slot, 0) if mine else 0)
        stale = {s: n for s, n in before.items() if s != slot} if claim or not mine else {}
        slots = {s: n for s, n in before.items() if s not in stale} | {slot: len(parts)}
        head = Head(self.run_id, (previous.generation if previous else 0) + 1, self.owner, slot, len(parts),
                    len(payload), len(text), hashlib.sha256(payload).hexdigest(), status, time.time(),
                    self.config.lease_s, slots)
        try:
            await self._swap_head(head, revision)
        except _Conflict:
            await self._purge(slot, range(len(parts)))  # not ours to keep: nothing points at them
            raise
        await self._purge(slot, shrunk)
        for other, count in stale.items():
            await self._purge(other, range(count))
        self._count("ok")
        if self.metrics is not None:
            self.metrics.state_bytes.record(len(payload))

    async def _swap_head(self, head: Head, revision: int) -> None:
        """The head updated if its revision is still `revision`. A refusal while the head still
        names this controller (an earlier write of its own whose answer was lost, or a restarted
        NATS that lost the last one) goes on from the head's revision; otherwise _Conflict."""
        for _ in range(3):
            try:
                await self.kv.update(self.key("head"), head.encode(), last=revision)
                return
            except nats.js.errors.KeyWrongLastSequenceError:
                current, revision, _ = await self._head()
                if current is None or current.owner.id != self.owner.id:
                    raise _Conflict(current) from None
        raise _Conflict(None)

    async def _purge(self, slot: str, indexes: range) -> None:
        for i in indexes:
            try:
                await self.kv.purge(self.key(slot, str(i)))
            except Exception as exc:  # leftover parts are garbage, not state: said, not fatal
                if not transient(exc):
                    raise
                log.warning("could not remove part %s.%d of run %s's state: %s", slot, i, self.run_id, exc)

    def _mirror(self, state: RunState, text: str) -> None:
        if not self.config.mirror or self.mirror_dir is None:
            return
        try:
            self.mirror_dir.mkdir(parents=True, exist_ok=True)
            state.save(self.mirror_dir, text)
        except OSError as exc:  # the copy only: the store has the state
            log.warning("could not write %s: %s", self.mirror_dir / STATE_FILE, exc)

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.state_saves.add(1, {"outcome": outcome})


async def retrying(what: str, op: Callable[[], Awaitable[T]], within_s: float) -> T:
    """`op()`, tried again with backoff (bounded to 2 s) while NATS does not answer, for `within_s`
    at most; StateUnavailable after that. Any other error is raised at once."""
    deadline = time.monotonic() + within_s
    delay = 0.25
    while True:
        try:
            return await op()
        except Exception as exc:
            if not transient(exc):
                raise
            if time.monotonic() + delay > deadline:
                raise StateUnavailable(f"{what}: NATS did not answer within {within_s:.0f} s "
                                       f"({type(exc).__name__}: {exc})") from None
            log.warning("%s: NATS did not answer (%s: %s); trying again", what, type(exc).__name__, exc)
        await asyncio.sleep(delay)
        delay = min(2 * delay, 2.0)
