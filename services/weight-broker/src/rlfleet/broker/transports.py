"""Weight transports: how one version gets into a set of engines.

Every transport implements `WeightTransport.update(engines, target)` and returns one
`UpdateOutcome` per engine (never raises for an engine's failure); contract tests
(`tests/test_transport_contract.py`) hold every implementation to the same behaviour: afterwards an
engine either serves exactly the trainer's weights of `target` and reports its version, or is
unchanged and the outcome says why.

The transport a version takes depends on the engine's kind (`EngineRef.kind`):

* `DiskDelta`, CPU engine: its own `/rlfleet/update_weights_from_store` (kind delta). The engine
  fetches, decodes and preverifies the delta while it serves, then pauses only for the in-place swap
  (pause mode from the config) and reports the pause.
* `DiskDelta`, SGLang engine: SGLang has no load format for deltas, so the node-local weight agent
  (here in broker mode: `rlfleet.weights.local_copy.LocalCopies`) fetches and checks the delta and
  applies it to its full copy of the engine's current version while the engine keeps generating,
  writes the new version as a plain HF directory, and only then has the engine load it
  (`update_weights_from_disk`, load format `auto`): only that load is inside the pause.
* `DiskFull`: the version rebuilt exactly from the store -- by the CPU engine itself (kind full), or
  by the weight agent into a plain HF directory before the pause (SGLang) -- with the engine paused
  around the load through the gateway's `PauseEngines` (so it routes elsewhere), or directly when
  there is no gateway.
* `Distributed`: SGLang's `init_weights_update_group` on each engine, with SGLang's rank
  arithmetic: the sender is rank 0, engine i joins at `rank_offset` = 1 + the TP sizes of the
  engines before it and takes one rank per TP rank, world size = 1 + the sum of TP sizes; then
  `update_weights_from_distributed` with names/dtypes/shapes while the sender (the trainer,
  `rlfleet.broker.distributed_sender` or `rlfleet.trainer.weight_sender`) broadcasts; the group is
  destroyed afterwards. With the trainer's checksums (StartTrainerSync), an engine whose reply's
  checksums (the CPU engine hashes what it received) differ failed.
* `PeerCommit` (p2p): the trainer wrote the version into the engine's Mooncake staging buffer; the
  engine verifies staging against the trainer's checksums and only then swaps. The same flip takes
  a staged broadcast in (`source` distributed): with `BroadcastPlan.staged`, a CPU engine only
  receives and hashes while it serves, so its pause is the pointer flip alone.
* `TensorHandOver` (tensor): same node, SGLang's `update_weights_from_tensor` with shared-memory handles.

Pause modes: the store transports send theirs in the body (CPU engine) or pause through the gateway;
the trainer-sent ones send `abort_all_requests` for abort, and the CPU engine takes retract / in_place
as its rlfleet query parameter `pause_mode` (SGLang's bodies have no such field). For an SGLang engine
a tensor update is wrapped in pause_generation(mode) / continue_generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from rlfleet.broker.pools import EngineRef, GatewayLink, Pools
from rlfleet.common.engine_client import EngineError, EngineRejected, PauseMode
from rlfleet.weights import DirectoryWeightStore, WeightStoreError
from rlfleet.weights.local_copy import LocalCopies, Staged
from rlfleet.weights.sent_checks import mismatched

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VersionInfo:
    """A version as the store holds it."""

    version: int
    path: str  # the version directory engines read
    kind: str  # full | delta
    base_version: int | None
    nbytes: int  # this version's files
    full_bytes: int  # all tensors in the served dtype
    changed_fraction: float | None

    @classmethod
    def from_store(cls, store: DirectoryWeightStore, version: int) -> VersionInfo:
        index = store.index(version)
        changed = None if index.changed_values is None else index.changed_values / max(index.total_values, 1)
        return cls(version, str(store.path(version)), index.kind, index.base_version,
                   index.total_bytes, index.full_bytes, changed)  # fmt: skip


@dataclass
class UpdateOutcome:
    engine_id: str
    version: int
    transport: str  # disk_delta | disk_full | distributed | p2p | tensor
    ok: bool
    pause_s: float = 0.0
    bytes: int = 0
    changed_fraction: float | None = None
    message: str = ""
    # The engine answered and refused (4xx / success false): the same request will not succeed.
    refused: bool = False
    reply: dict = field(default_factory=dict, repr=False)


class WeightTransport(Protocol):
    name: str

    async def update(self, engines: Sequence[EngineRef], target: VersionInfo) -> list[UpdateOutcome]:
        """Brings each engine to `target`; one outcome per engine, in order."""


def _failed(engine: EngineRef, target: VersionInfo, transport: str, exc: EngineError) -> UpdateOutcome:
    return UpdateOutcome(engine.engine_id, target.version, transport, False,
                         message=exc.message, refused=isinstance(exc, EngineRejected))  # fmt: skip


def _agent_refused(engine: EngineRef, target: VersionInfo, transport: str, message: str) -> UpdateOutcome:
    return UpdateOutcome(engine.engine_id, target.version, transport, False,
                         message=f"weight agent: {message}", refused=True)  # fmt: skip


def _loaded(engine: EngineRef, target: VersionInfo, transport: str, staged: Staged, reply: dict,
            pause_s: float, load_s: float) -> UpdateOutcome:
    stats = {"agent": "broker", "stage": staged.kind, "fetch_s": staged.fetch_s, "write_s": staged.write_s,
             "load_call_s": load_s, "local_copy": str(staged.path)}
    return UpdateOutcome(engine.engine_id, target.version, transport, True, pause_s, staged.payload_bytes,
                         staged.changed_fraction, str(reply.get("message", "")), reply={**reply, **stats})


class DiskDelta:
    name = "disk_delta"

    def __init__(self, pools: Pools, pause_mode: PauseMode = "retract",
                 copies: LocalCopies | None = None) -> None:
        self.pools = pools
        self.pause_mode = pause_mode
        self.copies = copies

    async def update(self, engines: Sequence[EngineRef], target: VersionInfo) -> list[UpdateOutcome]:
        return list(await asyncio.gather(*(self._one(e, target) for e in engines)))

    async def _one(self, engine: EngineRef, target: VersionInfo) -> UpdateOutcome:
        if engine.kind != "cpu":
            return await self._node_local(engine, target)
        try:
            reply = await self.pools.client(engine).load_from_store(
                target.path, "delta", weight_version=str(target.version), pause_mode=self.pause_mode
            )
        except EngineError as exc:
            return _failed(engine, target, self.name, exc)
        return UpdateOutcome(
            engine.engine_id, target.version, self.name, True, float(reply.get("pause_s", 0.0)),
            int(reply.get("bytes", target.nbytes)), reply.get("changed_fraction", target.changed_fraction),
            str(reply.get("message", "")), reply=reply,
        )  # fmt: skip

    async def _node_local(self, engine: EngineRef, target: VersionInfo) -> UpdateOutcome:
        """Delta applied to the agent's local full copy while the engine serves; then the engine loads it."""
        if self.copies is None:
            return _agent_refused(engine, target, self.name, "no local copies configured for SGLang engines")
        try:
            staged = await asyncio.to_thread(self.copies.stage_delta, target.version, holder=engine.engine_id)
        except WeightStoreError as exc:  # no copy of the base, corrupt delta, ...: a full load instead
            return _agent_refused(engine, target, self.name, str(exc))
        started = time.perf_counter()
        try:
            reply = await self.pools.client(engine).load_directory(str(staged.path),
                                                                   weight_version=str(target.version))
        except EngineError as exc:
            self.copies.discard(staged)
            return _failed(engine, target, self.name, exc)
        # SGLang holds requests for the whole load and reports no pause: the call's time bounds it. The
        # CPU engine reads the directory while serving and reports the swap alone.
        load_s = time.perf_counter() - started
        pause_s = float(reply.get("pause_s", load_s))
        self.copies.commit(staged, holder=engine.engine_id)
        return _loaded(engine, target, self.name, staged, reply, pause_s, load_s)


class Pauser:
    """Pauses an engine around a full reload: through the gateway when there is one (it then routes
    around the engine), directly on the engine otherwise or when the gateway cannot."""

    def __init__(self, pools: Pools, gateway: GatewayLink | None) -> None:
        self.pools = pools
        self.gateway = gateway

    async def pause(self, engine: EngineRef, mode: PauseMode) -> str:
        if self.gateway is not None and await self.gateway.pause(engine.engine_id, mode):
            return "gateway"
        await self.pools.client(engine).pause(mode)
        return "engine"

    async def resume(self, engine: EngineRef, how: str) -> None:
        if how == "gateway" and self.gateway is not None and await self.gateway.resume(engine.engine_id):
            return
        await self.pools.client(engine).resume()


class DiskFull:
    name = "disk_full"

    def __init__(self, pools: Pools, pauser: Pauser, pause_mode: PauseMode = "retract",
                 copies: LocalCopies | None = None) -> None:
        self.pools = pools
        self.pauser = pauser
        self.pause_mode = pause_mode
        self.copies = copies

    async def update(self, engines: Sequence[EngineRef], target: VersionInfo) -> list[UpdateOutcome]:
        return list(await asyncio.gather(*(self._one(e, target) for e in engines)))

    async def _one(self, engine: EngineRef, target: VersionInfo) -> UpdateOutcome:
        copies, staged = self.copies, None
        if engine.kind != "cpu":
            # The agent rebuilds the version into a plain HF directory before the pause.
            if copies is None:
                return _agent_refused(engine, target, self.name,
                                      "no local copies configured for SGLang engines")
            try:
                staged = await asyncio.to_thread(copies.stage_full, target.version)
            except WeightStoreError as exc:
                return _agent_refused(engine, target, self.name, str(exc))
        started = time.perf_counter()
        try:
            how = await self.pauser.pause(engine, self.pause_mode)
        except EngineError as exc:
            if copies is not None and staged is not None:
                copies.discard(staged)
            return _failed(engine, target, self.name, exc)
        try:
            client = self.pools.client(engine)
            if staged is None:
                reply = await client.load_from_store(target.path, "full", weight_version=str(target.version),
                                                     pause_mode=self.pause_mode)
            else:
                loading = time.perf_counter()
                reply = await client.load_directory(str(staged.path), weight_version=str(target.version))
                load_s = time.perf_counter() - loading
        except EngineError as exc:
            outcome = _failed(engine, target, self.name, exc)
            if copies is not None and staged is not None:
                copies.discard(staged)
        else:
            if copies is None or staged is None:
                outcome = UpdateOutcome(engine.engine_id, target.version, self.name, True,
                                        bytes=int(reply.get("bytes", 0)),
                                        message=str(reply.get("message", "")), reply=reply)  # fmt: skip
            else:
                copies.commit(staged, holder=engine.engine_id)
                outcome = _loaded(engine, target, self.name, staged, reply, 0.0, load_s)
        finally:
            try:
                await self.pauser.resume(engine, how)
            except EngineError as exc:  # the engine went away mid-update: it is down, whatever the load said
                log.warning("resuming %s after a full load failed: %s", engine.engine_id, exc)
        outcome.pause_s = time.perf_counter() - started
        return outcome


@dataclass(frozen=True)
class BroadcastPlan:
    """One broadcast from the sender (rank 0): where it rendezvous and what it sends, in order."""

    master_address: str
    master_port: int
    group_name: str
    backend: str
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    # Each engine's TP size, in the order of the engines the plan goes to; empty: 1 each.
    tp_sizes: tuple[int, ...] = ()
    # name -> the sender's checksum (TrainerSync): an engine whose reply's checksums differ failed.
    checksums: dict[str, str] = field(default_factory=dict)
    pause_mode: PauseMode = "in_place"
    # CPU engines only receive and hash (`staged=1`); the caller flips each in (PeerCommit, source
    # distributed), where a corrupted transfer is refused. SGLang engines swap on arrival.
    staged: bool = False

    def ranks(self, engines: int) -> tuple[list[int], int]:
        """(rank_offset of each engine, world size) by SGLang's rule (rank = rank_offset + tp_rank)."""
        return rank_layout(list(self.tp_sizes) or [1] * engines)

    @property
    def nbytes(self) -> int:
        sizes = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int64": 8, "int32": 4,
                 "int16": 2, "int8": 1, "uint8": 1, "bool": 1}  # fmt: skip
        total = 0
        for dtype, shape in zip(self.dtypes, self.shapes, strict=True):
            n = 1
            for s in shape:
                n *= s
            total += n * sizes.get(dtype, 4)
        return total


def rank_layout(tp_sizes: list[int]) -> tuple[list[int], int]:
    """The sender is rank 0; engine i starts at 1 + sum(tp_sizes[:i]); world = 1 + sum(tp_sizes)."""
    offsets, next_rank = [], 1
    for size in tp_sizes:
        if size < 1:
            raise ValueError(f"a TP size must be >= 1, got {size}")
        offsets.append(next_rank)
        next_rank += size
    return offsets, next_rank


async def engine_tp_size(pools: Pools, engine: EngineRef) -> int:
    """The engine's TP size (its ranks in a broadcast group), from /server_info; 0 when it cannot
    take a broadcast: unreachable, or data-parallel (SGLang's group path needs dp_size 1)."""
    try:
        info = await asyncio.wait_for(pools.client(engine).server_info(), 5.0)
    except (EngineError, TimeoutError):
        return 0
    if int(info.get("dp_size", 1)) != 1:
        log.warning("engine %s has dp_size %s: no broadcast (SGLang needs dp_size 1); it catches up "
                    "from the store", engine.engine_id, info.get("dp_size"))
        return 0
    return max(1, int(info.get("tp_size", 1)))


def engine_pause(engine: EngineRef, pause_mode: PauseMode) -> tuple[PauseMode | None, bool]:
    """(the CPU engine's pause_mode query parameter, abort_all_requests) for a trainer-sent swap.
    SGLang's bodies carry only abort_all_requests; it holds requests for the whole update itself."""
    return (pause_mode if engine.kind == "cpu" else None), pause_mode == "abort"


def checked(outcome: UpdateOutcome, expected: dict[str, str]) -> UpdateOutcome:
    """Fails an outcome whose engine reported checksums that are not the sender's. Engines that report
    none (SGLang) are taken at their word."""
    got = outcome.reply.get("checksums")
    if outcome.ok and expected and isinstance(got, dict):
        bad = mismatched(expected, got)
        if bad:
            outcome.ok = False
            outcome.message = f"{len(bad)} tensor(s) arrived with the wrong checksum: {', '.join(bad[:5])}"
    return outcome


class Distributed:
    name = "distributed"

    def __init__(self, pools: Pools, plan: BroadcastPlan) -> None:
        self.pools = pools
        self.plan = plan

    async def update(self, engines: Sequence[EngineRef], target: VersionInfo) -> list[UpdateOutcome]:
        plan = self.plan
        offsets, world = plan.ranks(len(engines))
        clients = [self.pools.client(e) for e in engines]
        # Every rank blocks in the rendezvous until all have arrived, the sender included.
        joined = await asyncio.gather(
            *(c.init_weights_update_group(plan.master_address, plan.master_port, offset, world,
                                          group_name=plan.group_name, backend=plan.backend)
              for offset, c in zip(offsets, clients, strict=True)),
            return_exceptions=True,
        )  # fmt: skip
        body = {"names": plan.names, "dtypes": plan.dtypes, "shapes": plan.shapes,
                "group_name": plan.group_name, "weight_version": str(target.version),
                "flush_cache": True}  # fmt: skip
        if any(isinstance(j, BaseException) for j in joined):
            replies: list = [j if isinstance(j, BaseException) else EngineRejected(
                "another engine failed to join the group; no broadcast", url="") for j in joined]  # fmt: skip
        else:
            modes = [engine_pause(e, plan.pause_mode) for e in engines]
            replies = await asyncio.gather(
                *(c.update_from_distributed({**body, "abort_all_requests": abort}, mode,
                                            staged=plan.staged and e.kind == "cpu")
                  for e, c, (mode, abort) in zip(engines, clients, modes, strict=True)),
                return_exceptions=True)  # fmt: skip
        await asyncio.gather(
            *(c.destroy_weights_update_group(plan.group_name) for c, j in zip(clients, joined, strict=True)
              if not isinstance(j, BaseException)),
            return_exceptions=True,
        )  # fmt: skip
        outcomes = []
        for engine, reply in zip(engines, replies, strict=True):
            if isinstance(reply, EngineError):
                outcomes.append(_failed(engine, target, self.name, reply))
            elif isinstance(reply, BaseException):
                raise reply
            else:
                outcome = UpdateOutcome(engine.engine_id, target.version, self.name, True,
                                        float(reply.get("pause_s", 0.0)), plan.nbytes,
                                        message=str(reply.get("message", "")), reply=reply)  # fmt: skip
                # A staged reply is checked by the engine itself when it is flipped in.
                outcomes.append(outcome if reply.get("staged") else checked(outcome, plan.checksums))
        return outcomes


class PeerCommit:
    """P2P, after the trainer wrote a version into the engine's staging: the engine checks staging
    against the sender's checksums and swaps (CPU engine: `/rlfleet/update_weights_from_staging`)."""

    name = "p2p"

    def __init__(self, pools: Pools, pause_mode: PauseMode, source: str = "p2p") -> None:
        self.pools = pools
        self.pause_mode = pause_mode
        self.source = source  # p2p: Mooncake staging; distributed: a staged broadcast
        self.name = source

    async def commit(self, engine: EngineRef, version: int, checksums: dict[str, str], algorithm: str,
                     sent_bytes: int, store_uri: str = "") -> UpdateOutcome:
        """`store_uri`: the store's copy of the version (P2P), which the engine then holds as its own
        (when the checksums match the store's), so the version after can come as a delta."""
        try:
            reply = await self.pools.client(engine).update_from_staging(
                checksums, algorithm, weight_version=str(version), pause_mode=self.pause_mode,
                source=self.source, model_path=store_uri if self.source == "p2p" else "")
        except EngineError as exc:
            return UpdateOutcome(engine.engine_id, version, self.name, False, message=exc.message,
                                 refused=isinstance(exc, EngineRejected))  # fmt: skip
        return UpdateOutcome(engine.engine_id, version, self.name, True, float(reply.get("pause_s", 0.0)),
                             sent_bytes, message=str(reply.get("message", "")), reply=reply)  # fmt: skip


class TensorHandOver:
    """Same node: SGLang's `update_weights_from_tensor` with the trainer's shared-memory handles; the
    engine copies the tensors out and (CPU engine) reports their checksums, checked here."""

    name = "tensor"

    def __init__(self, pools: Pools, pause_mode: PauseMode) -> None:
        self.pools = pools
        self.pause_mode = pause_mode

    async def update(self, engine: EngineRef, version: int, serialized: list[str], checksums: dict[str, str],
                     nbytes: int) -> UpdateOutcome:
        mode, abort = engine_pause(engine, self.pause_mode)
        client = self.pools.client(engine)
        paused = engine.kind != "cpu" and not abort and self.pause_mode != "in_place"
        try:
            if paused:  # SGLang's RL recipe: pause (retract) -> update -> continue
                await client.pause(self.pause_mode)
            started = time.perf_counter()
            reply = await client.update_from_tensor(serialized, weight_version=str(version), pause_mode=mode,
                                                    abort_all_requests=abort)
            call_s = time.perf_counter() - started
        except EngineError as exc:
            return UpdateOutcome(engine.engine_id, version, self.name, False, message=exc.message,
                                 refused=isinstance(exc, EngineRejected))  # fmt: skip
        finally:
            if paused:
                with contextlib.suppress(EngineError):
                    await client.resume()
        return checked(UpdateOutcome(engine.engine_id, version, self.name, True,
                                     float(reply.get("pause_s", call_s)), nbytes,
                                     message=str(reply.get("message", "")), reply=reply),
                       checksums)  # fmt: skip
