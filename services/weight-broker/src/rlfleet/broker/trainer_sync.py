"""Trainer-sent weights: the broker's half of StartTrainerSync / FinishTrainerSync / ConfirmTrainerSync.

    trainer: store write starts ──StartTrainerSync(version, tensors + checksums, rendezvous,
             store_pending)──▶ broker
    broker:  engines held for the trainer (with store_pending: no target moves yet; else the sync
             policy, canary first, makes it the target), each engine's transport
             ◀── TrainerSyncPlan: broadcast group (ranks by SGLang's arithmetic), P2P endpoints,
                 same-node tensor engines
    trainer: broadcasts (the broker has those engines receive into staging), writes into P2P staging,
             shares tensors -- all beside the store write -- then waits for the write
             ──FinishTrainerSync(which writes went through, tensor handles, the stored version or
               the store's error)──▶ broker
    broker:  store failed: the version is REJECTED, staging dropped, no engine changes. Else the
             stored version is announced and made the target, then P2P and staged-broadcast engines
             verify staging by checksum and flip it in (the pause is a pointer swap); tensor engines
             copy and swap (their checksums checked); outcomes recorded; engines released
             ◀── one outcome per engine

With `sync.flip_before_stored` (the default) the store write leaves the critical path: the trainer
finishes right after its transfers (`store_follows`), the broker makes the version the target as the
sync policy would (a provisional record: the store does not have it yet) and has the engines verify
and flip it in at once; the reconcile loop brings no other engine to it until ConfirmTrainerSync
reports the write. A write that failed (or no confirmation within `update_timeout_s`) rejects the
version: its pools' targets fall back, and the engines that flipped it in are relabelled
`unverified-<v>` so that the reconcile loop loads their targets from the store in full.

An engine whose transfer failed, arrived partial or could not be set up is released behind its
pool's target, so the reconcile loop brings it from the store (delta or full): the store keeps
every version for exactly this, and for catch-up, audit and rollback. One whose weights changed but
failed the check is relabelled first (`unverified-<v>`), so the loop never takes it for serving v.
A sync whose trainer never reports back is settled as failed after `update_timeout_s` (with
store_pending, nothing staged is flipped in).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rlfleet.api.broker.v1 import broker_pb2
from rlfleet.broker.config import TRAINER_SENT, transport_of
from rlfleet.broker.errors import BadAnnouncement, UnknownSync, UnknownVersion
from rlfleet.broker.pools import EngineRef
from rlfleet.broker.rollout import SyncResult
from rlfleet.broker.transports import (
    BroadcastPlan,
    Distributed,
    PeerCommit,
    TensorHandOver,
    UpdateOutcome,
    VersionInfo,
)
from rlfleet.common.engine_client import EngineError
from rlfleet.weights.codec import CHECKSUM_ALGORITHMS

if TYPE_CHECKING:
    from rlfleet.broker.broker import Broker

log = logging.getLogger(__name__)

PROTO_TRANSPORTS = {"distributed": broker_pb2.TRANSPORT_DISTRIBUTED, "p2p": broker_pb2.TRANSPORT_P2P,
                    "tensor": broker_pb2.TRANSPORT_TENSOR}


@dataclass
class PendingSync:
    sync_id: str
    version: int
    checksums: dict[str, str]
    algorithm: str
    nbytes: int
    peers: list[EngineRef] = field(default_factory=list)
    tensors: list[EngineRef] = field(default_factory=list)
    broadcast: list[EngineRef] = field(default_factory=list)
    broadcast_task: asyncio.Task | None = None
    store_pending: bool = False  # the store write runs beside the transfers: flip nothing before it lands
    # the store's copy of the version (known at start, or from the finish's stored version)
    store_uri: str = ""
    # flipped in before the store had it: awaiting ConfirmTrainerSync
    flipped: list[str] = field(default_factory=list)
    watchdog: asyncio.Task | None = None
    started: float = field(default_factory=time.monotonic)

    @property
    def engines(self) -> list[EngineRef]:
        return [*self.broadcast, *self.peers, *self.tensors]


class TrainerSyncs:
    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.sync = broker.config.sync
        self.pending: dict[str, PendingSync] = {}
        self.unconfirmed: dict[str, PendingSync] = {}  # flipped in before stored: awaiting ConfirmTrainerSync

    @property
    def unstored(self) -> set[int]:
        """Versions engines serve that the store may not hold yet: no engine is brought to one from it."""
        return {p.version for p in self.unconfirmed.values()}

    def transport(self, engine: EngineRef) -> str:
        return transport_of(self.sync, engine.engine_id, engine.transport)

    # --- start ----------------------------------------------------------------------------------
    async def start(self, request: broker_pb2.StartTrainerSyncRequest) -> broker_pb2.TrainerSyncPlan:
        b = self.broker
        _check(request)
        version = request.version.version
        for earlier in [p for p in self.unconfirmed.values() if p.version == version]:
            # Flipped in but never confirmed, and sent again: the trainer that sent it died before its
            # store write ended, and its successor reuses the number with other weights. The engines
            # holding the first one go back to the store; the number is not served directly again.
            if earlier.watchdog is not None:
                earlier.watchdog.cancel()
            await self._revert(earlier, f"version {version} is being sent again before its first send's "
                                        "store write was confirmed (a restarted trainer)")
        wanted = lambda e: self.transport(e) in TRAINER_SENT  # noqa: E731
        if request.store_pending:  # the version becomes a target only once the store has it (finish)
            engines = await b.hold_for_trainer(wanted)
            state = broker_pb2.VERSION_STATE_UNSPECIFIED
        else:
            await b.announce(request.version)
            engines = await b.take_for_trainer(version, wanted)
            state = (await b.registry.require(version)).state
        if not engines:
            return broker_pb2.TrainerSyncPlan(state=state)
        by = {t: [e for e in engines if self.transport(e) == t] for t in TRAINER_SENT}
        checksums = {t.name: t.checksum for t in request.tensors}
        pending = PendingSync(uuid.uuid4().hex, version, checksums, request.checksum_algorithm,
                              _nbytes(request.tensors), tensors=by["tensor"],
                              store_pending=request.store_pending,
                              store_uri="" if request.store_pending else request.version.uri)  # fmt: skip
        plan = broker_pb2.TrainerSyncPlan(
            sync_id=pending.sync_id, state=state, bucket_bytes=self.sync.p2p_bucket_bytes,
            tensor_engine_ids=[e.engine_id for e in by["tensor"]],
            flip_before_stored=request.store_pending and self.sync.flip_before_stored)  # fmt: skip
        pending.peers = await self._endpoints(by["p2p"], plan)
        await self._group(by["distributed"], request, pending, plan)
        if not pending.engines:
            return broker_pb2.TrainerSyncPlan(state=state)
        self.pending[pending.sync_id] = pending
        pending.watchdog = asyncio.create_task(self._expire(pending.sync_id))
        log.info("version %d straight from the trainer: broadcast %s, p2p %s, tensor %s", version,
                 [e.engine_id for e in pending.broadcast], [e.engine_id for e in pending.peers],
                 [e.engine_id for e in pending.tensors])  # fmt: skip
        return plan

    async def _endpoints(self, engines: list[EngineRef], plan: broker_pb2.TrainerSyncPlan) -> list[EngineRef]:
        """Each P2P engine's published endpoint; one that cannot publish goes back to the store path."""
        import json

        replies = await asyncio.gather(*(self.broker.pools.client(e).transfer_engine_info(0)
                                         for e in engines), return_exceptions=True)  # fmt: skip
        reachable = []
        for engine, reply in zip(engines, replies, strict=True):
            if isinstance(reply, EngineError | TimeoutError):
                log.warning("engine %s publishes no P2P endpoint (%s): it catches up from the store",
                            engine.engine_id, reply)  # fmt: skip
                self.broker.release([engine])
                continue
            if isinstance(reply, BaseException):
                raise reply
            plan.peers.add(engine_id=engine.engine_id, endpoint_json=json.dumps(reply))
            reachable.append(engine)
        return reachable

    async def _group(self, engines: list[EngineRef], request: broker_pb2.StartTrainerSyncRequest,
                     pending: PendingSync, plan: broker_pb2.TrainerSyncPlan) -> None:
        if not engines:
            return
        if not request.master_address or not request.master_port:
            log.warning("no rendezvous in StartTrainerSync: broadcast engines %s catch up from the store",
                        [e.engine_id for e in engines])  # fmt: skip
            self.broker.release(engines)
            return
        sizes = await asyncio.gather(*(self.broker.tp_size(e) for e in engines))
        self.broker.release([e for e, size in zip(engines, sizes, strict=True) if not size])
        pending.broadcast = [e for e, size in zip(engines, sizes, strict=True) if size]
        if not pending.broadcast:
            return
        group = BroadcastPlan(
            request.master_address, request.master_port,
            f"rlfleet-{self.broker.config.run_id}-v{pending.version}-{pending.sync_id[:6]}",
            request.backend or "gloo", [t.name for t in request.tensors], [t.dtype for t in request.tensors],
            [list(t.shape) for t in request.tensors], tuple(s for s in sizes if s),
            checksums=pending.checksums, pause_mode=self.sync.pause_mode, staged=True,
        )  # fmt: skip
        offsets, world = group.ranks(len(pending.broadcast))
        plan.broadcast.CopyFrom(broker_pb2.BroadcastGroup(
            group_name=group.group_name, world_size=world,
            engine_ids=[e.engine_id for e in pending.broadcast],
            rank_offsets=offsets, tp_sizes=group.tp_sizes))  # fmt: skip
        pending.broadcast_task = asyncio.create_task(self._broadcast(pending, group))

    async def _broadcast(self, pending: PendingSync, group: BroadcastPlan) -> list[UpdateOutcome]:
        # The version's number is all Distributed needs of it: the store may not have it yet.
        info = VersionInfo(pending.version, "", "", None, pending.nbytes, pending.nbytes, None)
        return await Distributed(self.broker.pools, group).update(pending.broadcast, info)

    # --- finish ---------------------------------------------------------------------------------
    async def finish(
        self, request: broker_pb2.FinishTrainerSyncRequest
    ) -> broker_pb2.FinishTrainerSyncResponse:
        pending = self.pending.pop(request.sync_id, None)
        if pending is None:
            raise UnknownSync(f"no trainer sync {request.sync_id!r} is open "
                              "(finished, expired or never started)")
        if pending.watchdog is not None:
            pending.watchdog.cancel()
        if request.store_follows:
            return await self._finish_before_stored(pending, request)
        refused = await self._stored(pending, request) if pending.store_pending else ""
        if refused:
            outcomes = await self._discard(pending, refused)
        else:
            outcomes = await self._outcomes(pending, request)
        await self._settle(pending, outcomes, discarded=bool(refused))
        return broker_pb2.FinishTrainerSyncResponse(outcomes=[_proto(o) for o in outcomes])

    async def _outcomes(self, pending: PendingSync, request: broker_pb2.FinishTrainerSyncRequest
                        ) -> list[UpdateOutcome]:
        sent = {p.engine_id: p for p in request.peers}
        mode = self.sync.pause_mode
        peer, tensor = PeerCommit(self.broker.pools, mode), TensorHandOver(self.broker.pools, mode)
        timeout = self.sync.update_timeout_s

        async def one_peer(engine: EngineRef) -> UpdateOutcome:
            result = sent.get(engine.engine_id)
            if result is None or not result.sent:
                why = ((result.error if result is not None else "") or request.error
                       or "the trainer did not send it")
                return UpdateOutcome(engine.engine_id, pending.version, "p2p", False, message=why)
            return await peer.commit(engine, pending.version, pending.checksums,
                                     pending.algorithm, result.bytes, pending.store_uri)

        async def one_tensor(engine: EngineRef) -> UpdateOutcome:
            if not request.serialized_named_tensors:
                return UpdateOutcome(engine.engine_id, pending.version, "tensor", False,
                                     message=request.error or "the trainer shared no tensors")  # fmt: skip
            return await tensor.update(engine, pending.version, list(request.serialized_named_tensors),
                                       pending.checksums, pending.nbytes)

        async def bounded(coro, engine: EngineRef, transport: str) -> UpdateOutcome:
            try:
                return await asyncio.wait_for(coro, timeout)
            except TimeoutError:
                return UpdateOutcome(engine.engine_id, pending.version, transport, False,
                                     message=f"no answer within {timeout}s")  # fmt: skip

        broadcast, direct = await asyncio.gather(
            self._flip_broadcast(pending, request.error),
            asyncio.gather(*(bounded(one_peer(e), e, "p2p") for e in pending.peers),
                           *(bounded(one_tensor(e), e, "tensor") for e in pending.tensors)))  # fmt: skip
        return [*broadcast, *direct]

    async def _finish_before_stored(self, pending: PendingSync, request: broker_pb2.FinishTrainerSyncRequest
                                    ) -> broker_pb2.FinishTrainerSyncResponse:
        """The transfers are done and the store write still runs: the version becomes the target now
        (as the sync policy would make it) and the engines flip it in; ConfirmTrainerSync follows."""
        if not (pending.store_pending and self.sync.flip_before_stored):
            why = ("store_follows needs a sync started with store_pending while the broker's "
                   "sync.flip_before_stored is on")
            outcomes = await self._discard(pending, why)
            await self._settle(pending, outcomes, discarded=True)
            raise BadAnnouncement(why)
        if request.error or not await self.broker.target_unstored(pending.version):
            why = request.error or "the sync policy did not make it a target"
            outcomes = await self._discard(pending, why)
            await self._settle(pending, outcomes, discarded=True)
            return broker_pb2.FinishTrainerSyncResponse(outcomes=[_proto(o) for o in outcomes])
        # before any flip: no engine is brought to it from the store
        self.unconfirmed[pending.sync_id] = pending
        outcomes = await self._outcomes(pending, request)
        pending.flipped = [o.engine_id for o in outcomes if o.ok]
        await self._settle(pending, outcomes)
        pending.watchdog = asyncio.create_task(self._expire_unconfirmed(pending.sync_id))
        return broker_pb2.FinishTrainerSyncResponse(outcomes=[_proto(o) for o in outcomes],
                                                    awaits_confirm=True)

    # --- confirm --------------------------------------------------------------------------------
    async def confirm(
        self, request: broker_pb2.ConfirmTrainerSyncRequest
    ) -> broker_pb2.ConfirmTrainerSyncResponse:
        pending = self.unconfirmed.get(request.sync_id)
        if pending is None:
            raise UnknownSync(f"no trainer sync {request.sync_id!r} awaits its store write (never flipped in "
                              "before stored, confirmed already, or expired)")
        if request.HasField("stored") and request.stored.version != pending.version:
            raise BadAnnouncement(f"sync {request.sync_id} is of version {pending.version}, "
                                  f"not {request.stored.version}")
        if pending.watchdog is not None:
            pending.watchdog.cancel()
        why = ""
        if request.store_error or not request.HasField("stored"):
            why = ("the weight store write failed: "
                   f"{request.store_error or 'the trainer reported no stored version'}")
        else:
            try:
                await self.broker.announce(request.stored)
            except (BadAnnouncement, UnknownVersion) as exc:
                why = f"its stored version's announcement was refused: {exc}"
        if why:
            reverted = await self._revert(pending, why)
            state = broker_pb2.VERSION_STATE_REJECTED
        else:
            await self._adopt_stored(pending, request.stored.uri)
            self.unconfirmed.pop(pending.sync_id, None)
            self.broker.wake()
            reverted, state = [], (await self.broker.registry.require(pending.version)).state
        return broker_pb2.ConfirmTrainerSyncResponse(state=state, reverted_engine_ids=reverted)

    async def _adopt_stored(self, pending: PendingSync, store_uri: str) -> None:
        """The P2P engines that flipped the version in before it was stored hold the store's copy now
        (each checks the checksums), so a later fallback of theirs can be a delta."""
        client = self.broker.pools.client
        peers = [e for e in pending.peers if e.engine_id in pending.flipped and e.kind == "cpu"]
        replies = await asyncio.gather(
            *(client(e).adopt_store_version(store_uri, weight_version=str(pending.version)) for e in peers),
            return_exceptions=True)  # fmt: skip
        for engine, reply in zip(peers, replies, strict=True):
            if isinstance(reply, BaseException):
                log.warning("engine %s holds no store copy of version %d (its next store update is a full "
                            "load): %s", engine.engine_id, pending.version, reply)  # fmt: skip

    async def _revert(self, pending: PendingSync, why: str) -> list[str]:
        """A version served before the store had it, that the store will not have: rejected (its pools'
        targets fall back), and the engines that flipped it in relabelled, so that the reconcile loop
        takes them for what they are (no version of the store) and loads their targets in full."""
        log.error("version %d was flipped into %s before the store had it, and %s: sending them back",
                  pending.version, pending.flipped, why)  # fmt: skip
        # Relabelled first: until the pop below, the reconcile loop leaves engines alone whose target
        # is this version, and after it none may take the label for a version of the store.
        engines = {e.engine_id: e for e in pending.engines}
        for engine_id in pending.flipped:
            with contextlib.suppress(EngineError):
                await self.broker.pools.client(engines[engine_id]).update_weight_version(
                    f"unverified-{pending.version}")
        await self.broker.reject_served(pending.version, f"served before stored, then {why}")
        self.unconfirmed.pop(pending.sync_id, None)
        self.broker.wake()
        return list(pending.flipped)

    async def _expire_unconfirmed(self, sync_id: str) -> None:
        await asyncio.sleep(self.sync.update_timeout_s)
        pending = self.unconfirmed.get(sync_id)
        if pending is not None:
            await self._revert(pending, "the trainer never confirmed its store write within "
                                        f"{self.sync.update_timeout_s}s")

    async def _stored(self, pending: PendingSync, request: broker_pb2.FinishTrainerSyncRequest) -> str:
        """With the store write beside the send: announces the stored version and makes it a target
        (the sync policy's choice). Returns why nothing may be flipped in ("" when all may); a failed
        store write rejects the version."""
        b = self.broker
        if request.store_error or not request.HasField("stored"):
            why = ("the weight store write failed: "
                   f"{request.store_error or 'the trainer reported no stored version'}")
            await b.reject_unstored(pending.version, why)
            return f"version rejected: {why}"
        if request.stored.version != pending.version:
            return f"the stored version is {request.stored.version}, not {pending.version}"
        pending.store_uri = request.stored.uri
        try:
            await b.announce(request.stored)
        except (BadAnnouncement, UnknownVersion) as exc:
            await b.reject_unstored(pending.version, f"its announcement was refused: {exc}")
            return f"version rejected: the stored version's announcement was refused: {exc}"
        if not await b.target_for_trainer(pending.version):
            return "the sync policy did not make it a target"
        return ""

    async def _discard(self, pending: PendingSync, why: str) -> list[UpdateOutcome]:
        """Nothing staged is flipped in: every engine keeps what it serves (a staged broadcast is
        dropped; P2P staging is simply overwritten by the next write; no tensor was handed over)."""
        client = self.broker.pools.client
        received = await self._broadcast_outcomes(pending, "")
        await asyncio.gather(*(client(e).discard_staged_broadcast()
                               for e, o in zip(pending.broadcast, received, strict=True)
                               if o.reply.get("staged")), return_exceptions=True)  # fmt: skip
        return [UpdateOutcome(e.engine_id, pending.version, self.transport(e), False, message=why)
                for e in pending.engines]

    async def _broadcast_outcomes(self, pending: PendingSync, error: str) -> list[UpdateOutcome]:
        if pending.broadcast_task is None:
            return []
        try:
            return await asyncio.wait_for(pending.broadcast_task, self.sync.update_timeout_s)
        except Exception as exc:  # a broadcast that died or hung: every engine of it failed
            why = error or f"broadcast did not complete: {exc!r}"
            return [UpdateOutcome(e.engine_id, pending.version, "distributed", False, message=why)
                    for e in pending.broadcast]

    async def _flip_broadcast(self, pending: PendingSync, error: str) -> list[UpdateOutcome]:
        """Engines that staged the broadcast verify it against the trainer's checksums and flip it in
        (a corrupted one is refused there and nothing changes); others answered already."""
        received = await self._broadcast_outcomes(pending, error)
        flip = PeerCommit(self.broker.pools, self.sync.pause_mode, source="distributed")

        async def one(engine: EngineRef, outcome: UpdateOutcome) -> UpdateOutcome:
            if not (outcome.ok and outcome.reply.get("staged")):
                return outcome
            flipped = await flip.commit(engine, pending.version, pending.checksums, pending.algorithm,
                                        outcome.bytes)
            if flipped.ok:  # a refused flip changed nothing: no reply that would have it relabelled
                flipped.reply = {**outcome.reply, **flipped.reply}
            return flipped

        return list(await asyncio.gather(*(one(e, o)
                                           for e, o in zip(pending.broadcast, received, strict=True))))

    async def _settle(self, pending: PendingSync, outcomes: list[UpdateOutcome],
                      discarded: bool = False) -> None:
        b = self.broker
        try:
            for engine, outcome in zip(pending.engines, outcomes, strict=True):
                b.metrics.record(outcome)
                if discarded:  # nothing changed on the engine: it serves what it served
                    previous = await b.registry.engine(engine.engine_id)
                    kept = (None if previous is None or previous.policy_version < 0
                            else previous.policy_version)
                    log.warning("engine %s keeps version %s: %s", engine.engine_id, kept, outcome.message)
                    await b.record_engine(engine, SyncResult(engine.engine_id, pending.version,
                                                             [outcome], kept), kept)
                    continue
                b.copies.forget(engine.engine_id)  # weights came from the trainer: no local copy
                if not outcome.ok and outcome.reply:  # swapped, then failed the check: never "serving v"
                    with contextlib.suppress(EngineError):
                        await b.pools.client(engine).update_weight_version(f"unverified-{pending.version}")
                serving = pending.version if outcome.ok else None
                if not outcome.ok:
                    log.warning("engine %s: %s of version %d failed (%s); it catches up from the store",
                                engine.engine_id, outcome.transport, pending.version,
                                outcome.message)  # fmt: skip
                await b.record_engine(engine,
                                      SyncResult(engine.engine_id, pending.version, [outcome], serving),
                                      pending.version)  # fmt: skip
        finally:
            b.release(pending.engines)
        await b.advance()
        b.wake()

    async def _expire(self, sync_id: str) -> None:
        await asyncio.sleep(self.sync.update_timeout_s)
        pending = self.pending.pop(sync_id, None)
        if pending is None:
            return
        log.error("trainer sync %s (version %d) not finished within %ss: settled as failed", sync_id,
                  pending.version, self.sync.update_timeout_s)  # fmt: skip
        why = "the trainer never reported the transfer"
        if pending.store_pending:  # the store may never get it: nothing staged is flipped in
            await self._settle(pending, await self._discard(pending, why), discarded=True)
            return
        outcomes = await self._outcomes(pending,
                                        broker_pb2.FinishTrainerSyncRequest(sync_id=sync_id, error=why))
        await self._settle(pending, outcomes)

    async def stop(self) -> None:
        for pending in [*self.pending.values(), *self.unconfirmed.values()]:
            for task in (pending.watchdog, pending.broadcast_task):
                if task is not None:
                    task.cancel()
        self.pending.clear()
        self.unconfirmed.clear()


def _check(request: broker_pb2.StartTrainerSyncRequest) -> None:
    if not request.tensors:
        raise BadAnnouncement("StartTrainerSync needs the tensors to be sent "
                              "(names, dtypes, shapes, checksums)")
    if request.checksum_algorithm not in CHECKSUM_ALGORITHMS:
        raise BadAnnouncement(f"checksum_algorithm {request.checksum_algorithm!r} is not "
                              f"one of {CHECKSUM_ALGORITHMS}")
    if any(not t.checksum for t in request.tensors):
        raise BadAnnouncement("every tensor of a StartTrainerSync needs its checksum")


def _nbytes(tensors) -> int:
    return BroadcastPlan("", 0, "", "", [], [t.dtype for t in tensors],
                         [list(t.shape) for t in tensors]).nbytes


def _proto(outcome: UpdateOutcome) -> broker_pb2.EngineSyncOutcome:
    return broker_pb2.EngineSyncOutcome(
        engine_id=outcome.engine_id,
        transport=PROTO_TRANSPORTS.get(outcome.transport, broker_pb2.TRANSPORT_UNSPECIFIED),
        ok=outcome.ok,
        pause_s=outcome.pause_s,
        bytes=outcome.bytes,
        message=outcome.message,
        falls_back=not outcome.ok,
    )
