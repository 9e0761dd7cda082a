"""The broker: version announcements in, pool targets out, and a reconcile loop that makes every
engine serve its pool's target.

    announce(v)  -> registry: ANNOUNCED; sync policy: canary target = v (older waiting: SKIPPED)
    reconcile    -> each engine: its weight_version (/model_info); behind its pool's target -> Rollout.sync
                    a canary engine serves v -> CANARY (auto_promote: ACCEPTED, fleet target = v)
    Promote(v)   -> v must be CANARY: ACCEPTED, fleet target = v
    PinCandidate(v) -> v must be CANARY or ACCEPTED: candidate target = v (the gate evaluates it there
                    while the canary pool, which serves rollouts, moves on; unpinned: the fleet's)
    Rollback()   -> canary and fleet targets = the newest ACCEPTED version older than the current one,
                    the candidate pin cleared; newer accepted versions ROLLED_BACK, newer canary
                    versions REJECTED

Adapter versions (LoRA, see adapters.py): a target that is an adapter version brings engines to
its full base version, then the round loads the candidate and the accepted adapter side by side on
every engine and points the gateway's adapter routes at them: promotion and rollback of adapters
are route switches, with no weight copy and no pause.

Targets are level-triggered: a change only updates the registry and wakes the loop, so an engine
that was down, a new engine, or a restarted broker converge the same way. An engine the broker is
updating is `busy` and skipped by other rounds. A version no engine can load in full (the store
cannot rebuild it exactly) is REJECTED and its pool falls back to the previous good version; an
engine that cannot load a version other engines serve is left alone for `RETRY_REFUSED_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from pathlib import Path

from rlfleet.api.broker.v1 import broker_pb2
from rlfleet.api.common.v1 import common_pb2
from rlfleet.broker.adapters import AdapterRound, AdapterSync
from rlfleet.broker.config import WeightBrokerConfig, transport_of
from rlfleet.broker.errors import BadAnnouncement, NothingToRollBackTo, NotPromotable, UnknownVersion
from rlfleet.broker.metrics import BrokerMetrics
from rlfleet.broker.policy import SyncPolicy
from rlfleet.broker.pools import EngineRef, GatewayLink, Pools
from rlfleet.broker.registry import State, Targets, VersionRegistry, now_ms, state_name
from rlfleet.broker.rollout import Rollout, SyncResult
from rlfleet.broker.trainer_sync import TrainerSyncs
from rlfleet.broker.transports import BroadcastPlan, Distributed, UpdateOutcome, VersionInfo, engine_tp_size
from rlfleet.common.adapter_routes import AdapterRoutes
from rlfleet.common.engine_client import EngineError
from rlfleet.weights import DirectoryWeightStore, PathOutsideStore, VersionNotFound, WeightStoreError
from rlfleet.weights.local_copy import LocalCopies

log = logging.getLogger(__name__)

TRANSPORTS = {
    "disk_full": broker_pb2.TRANSPORT_DISK_FULL,
    "disk_delta": broker_pb2.TRANSPORT_DISK_DELTA,
    "distributed": broker_pb2.TRANSPORT_DISTRIBUTED,
    "p2p": broker_pb2.TRANSPORT_P2P,
    "tensor": broker_pb2.TRANSPORT_TENSOR,
}
RETRY_REFUSED_S = 30.0
SERVED = {State.VERSION_STATE_CANARY, State.VERSION_STATE_ACCEPTED}


def parse_version(weight_version: str) -> int | None:
    try:
        return int(weight_version)
    except ValueError:
        return None


class Broker:
    def __init__(
        self,
        config: WeightBrokerConfig,
        registry: VersionRegistry,
        store: DirectoryWeightStore,
        pools: Pools,
        gateway: GatewayLink | None,
        metrics: BrokerMetrics,
    ) -> None:
        self.config = config
        self.registry = registry
        self.store = store
        self.pools = pools
        self.gateway = gateway
        self.metrics = metrics
        self.policy = SyncPolicy(config.sync)
        self.copies = LocalCopies(store, config.local_copies or Path(store.root) / ".local-copies")
        self.rollout = Rollout(store, pools, gateway, metrics, config.sync, self.copies)
        self.adapters = AdapterSync(store, pools, AdapterRoutes(registry.redis, config.run_id))
        self._lock = asyncio.Lock()  # targets and version states
        self._busy: set[str] = set()  # engines being updated
        self._refused: dict[str, tuple[int, float]] = {}  # engine -> (version it refused, retry after)
        self._counts: dict[str, tuple[int, int]] = {}  # engine -> (updates, fallbacks) since start
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # set while no engine is busy
        self._idle.set()
        self._rounds_allowed = asyncio.Event()  # cleared while a broadcast is being set up
        self._rounds_allowed.set()
        self._holds = 0
        self._tasks: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None
        self.trainer_syncs = TrainerSyncs(self)

    # --- life -----------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._reconcile_loop(), name="broker-reconcile")

    async def stop(self) -> None:
        await self.trainer_syncs.stop()
        tasks = [t for t in (self._loop_task, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def wake(self) -> None:
        self._wake.set()

    # --- announcements --------------------------------------------------------------------------
    def _validate(self, pv: common_pb2.PolicyVersion) -> int:
        if pv.schema_version != common_pb2.SCHEMA_VERSION_1:
            raise BadAnnouncement("PolicyVersion schema_version "
                                  f"{pv.schema_version} is not supported (want 1)")
        if pv.run_id and pv.run_id != self.config.run_id:
            raise BadAnnouncement(f"PolicyVersion of run {pv.run_id!r} sent to the broker of "
                                  f"run {self.config.run_id!r}")
        if pv.version < 0:
            raise BadAnnouncement(f"version {pv.version} is negative")
        for name, uri in (("uri", pv.uri or str(self.store.path(pv.version))), ("full_uri", pv.full_uri)):
            if not uri:
                continue
            try:
                named = self.store.version_from_uri(uri)
            except PathOutsideStore as exc:
                raise BadAnnouncement(f"{name}: {exc}") from None
            except VersionNotFound as exc:
                raise BadAnnouncement(f"{name}: {exc}") from None
            if name == "uri" and named != pv.version:
                raise BadAnnouncement(f"uri {uri!r} names version {named}, not {pv.version}")
        try:
            self.store.index(pv.version)
        except VersionNotFound as exc:
            raise UnknownVersion(pv.version, f"not in the weight store ({exc})") from None
        except WeightStoreError as exc:
            raise BadAnnouncement(f"version {pv.version} in the store is unreadable: {exc}") from None
        return pv.version

    async def announce(self, pv: common_pb2.PolicyVersion) -> broker_pb2.VersionState:
        """Records a version (idempotent) and applies the sync policy; returns its state."""
        version = await asyncio.to_thread(self._validate, pv)
        async with self._lock:
            record = await self.registry.get(version)
            if record is None:
                stored = common_pb2.PolicyVersion()
                stored.CopyFrom(pv)
                stored.run_id = self.config.run_id
                stored.uri = stored.uri or self.store.uri(version)
                record = broker_pb2.VersionRecord(
                    version=stored, state=State.VERSION_STATE_ANNOUNCED, announced_unix_ms=now_ms()
                )
                await self.registry.put(record)
                targets = await self.registry.targets()
                await self.registry.set_targets(latest=max(version, targets.latest or version))
                log.info("version %d announced", version)
            elif not record.version.uri:  # provisional (served before the store had it): now it has
                state = record.state
                record.version.CopyFrom(pv)
                record.version.run_id = self.config.run_id
                record.version.uri = record.version.uri or self.store.uri(version)
                record.state = state
                await self.registry.put(record)
                log.info("version %d, served before the store had it, is stored", version)
            # An adapter version always goes by the store (`/load_lora_adapter` names its directory; no
            # trainer sends adapters), so it is never left waiting `trainer_wait_s` for a trainer send.
            if not self._trainer_decides or self.adapters.is_adapter(version):
                await self._apply_policy()
            # Put above: gone only if the run's registry keys were deleted meanwhile.
            record = await self.registry.require(version)
        self.wake()
        return record.state

    @property
    def _trainer_decides(self) -> bool:
        """With trainer-sent engines a version becomes a target when the trainer starts sending it
        (StartTrainerSync / StartDistributedSync), not when it is announced: else the reconcile loop
        would race the trainer and load it from the store."""
        return self.policy.transport == "distributed" or self.config.trainer_sends

    async def _apply_unsent(self) -> None:
        """Under the lock: versions no trainer started sending within trainer_wait_s go by the store."""
        targets = await self.registry.targets()
        waiting = await self._waiting(targets)
        wait_ms = self.config.sync.trainer_wait_s * 1000
        if waiting and now_ms() - min(waiting.values()) >= wait_ms:
            chosen = await self._apply_policy()
            if chosen is not None:
                log.warning("version %d: no trainer sent it within %.0fs; engines load it from the store",
                            chosen, self.config.sync.trainer_wait_s)

    async def _waiting(self, targets: Targets) -> dict[int, int]:
        """ANNOUNCED versions not yet made a target -> announce time."""
        records = await self.registry.records(await self.registry.versions())
        return {
            r.version.version: r.announced_unix_ms
            for r in records
            if r.state == State.VERSION_STATE_ANNOUNCED and r.version.version != targets.canary
        }

    async def _apply_policy(self, only: int | None = None) -> int | None:
        """Under the lock: makes the policy's choice the canary target; returns it. With `only`,
        nothing happens unless the choice is that version."""
        targets = await self.registry.targets()
        decision = self.policy.decide(targets.last_synced, await self._waiting(targets), now_ms())
        if only is not None and decision.version != only:
            return None
        for version in decision.skipped:
            await self._set_state(version, State.VERSION_STATE_SKIPPED, "passed over by the sync policy")
        if decision.version is None:
            return None
        if targets.canary is not None:
            # A canary target that no canary engine served yet is superseded.
            await self._set_state(targets.canary, State.VERSION_STATE_SKIPPED,
                                  f"superseded by {decision.version} before the canary served it",
                                  only_from={State.VERSION_STATE_ANNOUNCED})  # fmt: skip
        await self.registry.set_targets(canary=decision.version, last_synced=decision.version)
        log.info("version %d -> canary pool (%s)", decision.version, decision.reason)
        if self.config.auto_promote and not self.pools.members("canary"):
            await self._accept(decision.version, "auto_promote (no canary engines)")
        return decision.version

    async def _set_state(self, version: int, state: broker_pb2.VersionState, reason: str,
                         only_from: set[broker_pb2.VersionState] | None = None) -> None:
        record = await self.registry.get(version)
        if record is not None and (only_from is None or record.state in only_from):
            await self.registry.set_state(record, state, reason)

    async def _accept(self, version: int, reason: str) -> None:
        await self._set_state(version, State.VERSION_STATE_ACCEPTED, reason)
        await self.registry.set_targets(fleet=version)
        log.info("version %d accepted: %s", version, reason)

    # --- promotion and rollback -----------------------------------------------------------------
    async def promote(self, version: int, reason: str) -> int:
        async with self._lock:
            record = await self.registry.get(version)
            if record is None:
                raise UnknownVersion(version)
            targets = await self.registry.targets()
            if record.state == State.VERSION_STATE_ACCEPTED and targets.fleet == version:
                return version
            if record.state != State.VERSION_STATE_CANARY:
                raise NotPromotable(
                    f"version {version} is {state_name(record.state)}: only a version the canary pool "
                    "served (CANARY) can be promoted"
                )
            if targets.fleet is not None and version < targets.fleet:
                raise NotPromotable(f"version {version} is older than the accepted "
                                    f"{targets.fleet}; use Rollback")
            await self._accept(version, reason or "promoted")
        self.wake()
        return version

    async def pin_candidate(self, version: int, reason: str) -> int:
        async with self._lock:
            record = await self.registry.require(version)
            if self.adapters.is_adapter(version):
                raise NotPromotable(f"version {version} is an adapter: adapter candidates are served beside "
                                    "the accepted adapter on every engine, with no candidate pool")
            if record.state not in SERVED:
                raise NotPromotable(
                    f"version {version} is {state_name(record.state)}: only a version the canary pool "
                    "served (CANARY) or an accepted one can be pinned for the candidate pool")
            await self.registry.set_targets(candidate=version)
            log.info("version %d pinned on the candidate pool: %s", version, reason or "pinned")
        self.wake()
        return version

    async def rollback(self, to_version: int, reason: str) -> int:
        reason = reason or "rollback"
        async with self._lock:
            targets = await self.registry.targets()
            current = max((v for v in (targets.canary, targets.fleet) if v is not None), default=None)
            if to_version:
                record = await self.registry.get(to_version)
                if record is None:
                    raise UnknownVersion(to_version)
                if record.state != State.VERSION_STATE_ACCEPTED:
                    raise NothingToRollBackTo(
                        f"version {to_version} is {state_name(record.state)}; only an accepted version "
                        "can be rolled back to"
                    )
                target = to_version
            else:
                older = None if current is None else await self.registry.newest_in_state(
                    {State.VERSION_STATE_ACCEPTED}, below=current)  # fmt: skip
                if older is None:
                    raise NothingToRollBackTo(
                        "nothing accepted to roll back to" if current is None
                        else "nothing accepted to roll back to: "
                             f"no accepted version older than the current {current}"
                    )  # fmt: skip
                target = older
            if current is not None and current > target:
                for record in await self.registry.records(await self.registry.versions(target + 1, current)):
                    if record.state == State.VERSION_STATE_ACCEPTED:
                        await self.registry.set_state(record, State.VERSION_STATE_ROLLED_BACK, reason)
                    elif record.state in (State.VERSION_STATE_CANARY, State.VERSION_STATE_ANNOUNCED):
                        await self.registry.set_state(record, State.VERSION_STATE_REJECTED, reason)
            await self.registry.set_targets(canary=target, fleet=target, candidate=None)
            log.info("rolled back to version %d: %s", target, reason)
        self.wake()
        return target

    # --- the distributed transport --------------------------------------------------------------
    async def start_distributed(
        self, request: broker_pb2.StartDistributedSyncRequest
    ) -> broker_pb2.StartDistributedSyncResponse:
        version = request.version.version
        state = await self.announce(request.version)
        if self.policy.transport != "distributed":
            raise NotPromotable(f"the broker's transport is {self.policy.transport}, not distributed")
        if not request.master_address or not request.master_port or not request.tensors:
            raise BadAnnouncement("StartDistributedSync needs master_address, master_port and tensors")
        # No reconcile round may take engines while the broadcast is set up; one under way may finish.
        self._hold_rounds(True)
        try:
            await self._wait_idle(5.0)
            async with self._lock:
                chosen = await self._apply_policy(only=version)
                if chosen is None:
                    record = await self.registry.require(version)
                    return broker_pb2.StartDistributedSyncResponse(world_size=1, state=record.state)
                if self.config.auto_promote:
                    await self._accept(version, "auto_promote (broadcast to every pool)")
                pools = ("canary", "fleet") if self.config.auto_promote else ("canary",)
                await self.pools.refresh()
                candidates = [e for p in pools for e in self.pools.members(p)
                              if e.engine_id not in self._busy]
                sizes = await asyncio.gather(*(self._tp_size(e) for e in candidates))
                engines = [e for e, size in zip(candidates, sizes, strict=True) if size]
                tp_sizes = tuple(size for size in sizes if size)
                self._claim(e.engine_id for e in engines)
                state = (await self.registry.require(version)).state
        finally:
            self._hold_rounds(False)
        plan = BroadcastPlan(
            request.master_address, request.master_port,
            f"rlfleet-{self.config.run_id}-v{version}-{uuid.uuid4().hex[:6]}", request.backend or "gloo",
            [t.name for t in request.tensors], [t.dtype for t in request.tensors],
            [list(t.shape) for t in request.tensors], tp_sizes,
        )  # fmt: skip
        offsets, world = plan.ranks(len(engines))
        if engines:
            self._spawn(self._broadcast(engines, plan, version))
        return broker_pb2.StartDistributedSyncResponse(
            group_name=plan.group_name, world_size=world, engine_ids=[e.engine_id for e in engines],
            state=state, rank_offsets=offsets, tp_sizes=tp_sizes,
        )  # fmt: skip

    async def take_for_trainer(self, version: int, wanted) -> list[EngineRef]:
        """Makes `version` the canary target (both pools' with auto_promote) if the sync policy takes it,
        and holds the engines of those pools that `wanted` names for the trainer: no reconcile round
        touches them until they are released."""
        self._hold_rounds(True)
        try:
            await self._wait_idle(5.0)
            async with self._lock:
                if await self._apply_policy(only=version) is None:
                    return []
                if self.config.auto_promote:
                    await self._accept(version, "auto_promote (sent to every pool)")
                pools = ("canary", "fleet") if self.config.auto_promote else ("canary",)
                await self.pools.refresh()
                engines = [e for p in pools for e in self.pools.members(p)
                           if e.engine_id not in self._busy and wanted(e)]
                self._claim(e.engine_id for e in engines)
                return engines
        finally:
            self._hold_rounds(False)

    async def hold_for_trainer(self, wanted) -> list[EngineRef]:
        """The engines `take_for_trainer` would hold, held before the version is in the store (the
        trainer writes it beside the send): no target changes until `target_for_trainer`."""
        self._hold_rounds(True)
        try:
            await self._wait_idle(5.0)
            async with self._lock:
                pools = ("canary", "fleet") if self.config.auto_promote else ("canary",)
                await self.pools.refresh()
                engines = [e for p in pools for e in self.pools.members(p)
                           if e.engine_id not in self._busy and wanted(e)]
                self._claim(e.engine_id for e in engines)
                return engines
        finally:
            self._hold_rounds(False)

    async def target_for_trainer(self, version: int) -> bool:
        """The stored (and announced) version of a held trainer sync made the target as
        `take_for_trainer` would; False when the sync policy does not take it."""
        async with self._lock:
            if await self._apply_policy(only=version) is None:
                return False
            if self.config.auto_promote:
                await self._accept(version, "auto_promote (sent to every pool)")
            return True

    async def target_unstored(self, version: int) -> bool:
        """A version the trainer sent and engines are about to flip in before the store has it, made
        the target as `target_for_trainer` would (a provisional record, completed when it is
        announced); False, and nothing recorded, when the sync policy would not take it."""
        async with self._lock:
            if await self.registry.get(version) is None:
                targets = await self.registry.targets()
                waiting = {**await self._waiting(targets), version: now_ms()}
                if self.policy.decide(targets.last_synced, waiting, now_ms()).version != version:
                    return False
                await self.registry.put(broker_pb2.VersionRecord(
                    version=common_pb2.PolicyVersion(schema_version=common_pb2.SCHEMA_VERSION_1,
                                                     run_id=self.config.run_id, version=version),
                    state=State.VERSION_STATE_ANNOUNCED, announced_unix_ms=now_ms()))  # fmt: skip
                await self.registry.set_targets(latest=max(version, targets.latest or version))
            if await self._apply_policy(only=version) is None:
                return False
            if self.config.auto_promote:
                await self._accept(version, "auto_promote (sent to every pool)")
            return True

    async def reject_served(self, version: int, reason: str) -> None:
        """A version engines served that cannot stay (its store write failed): REJECTED, pools fall back."""
        await self._reject(version, reason)

    async def reject_unstored(self, version: int, reason: str) -> None:
        """A version the trainer sent but the store never got (or refused): recorded REJECTED, never a
        target."""
        async with self._lock:
            record = await self.registry.get(version)
            if record is None:
                record = broker_pb2.VersionRecord(
                    version=common_pb2.PolicyVersion(schema_version=common_pb2.SCHEMA_VERSION_1,
                                                     run_id=self.config.run_id, version=version),
                    state=State.VERSION_STATE_ANNOUNCED, announced_unix_ms=now_ms())  # fmt: skip
                await self.registry.put(record)
            await self.registry.set_state(record, State.VERSION_STATE_REJECTED, reason)
            log.error("version %d rejected: %s", version, reason)

    def release(self, engines) -> None:
        self._release(e.engine_id for e in engines)

    async def tp_size(self, engine: EngineRef) -> int:
        return await self._tp_size(engine)

    async def record_engine(self, engine: EngineRef, result: SyncResult, target: int | None) -> None:
        await self._record_engine(engine, result, target)

    async def advance(self) -> None:
        await self._advance()

    def _hold_rounds(self, hold: bool) -> None:
        self._holds += 1 if hold else -1
        if self._holds:
            self._rounds_allowed.clear()
        else:
            self._rounds_allowed.set()

    async def _wait_idle(self, within_s: float) -> None:
        """Lets a reconcile round that holds engines finish (it is short unless it is loading weights)."""
        if self._busy:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), within_s)

    def _claim(self, engine_ids) -> None:
        self._busy.update(engine_ids)
        if self._busy:
            self._idle.clear()

    def _release(self, engine_ids) -> None:
        self._busy.difference_update(engine_ids)
        if not self._busy:
            self._idle.set()

    async def _tp_size(self, engine: EngineRef) -> int:
        return await engine_tp_size(self.pools, engine)

    async def _broadcast(self, engines: list[EngineRef], plan: BroadcastPlan, version: int) -> None:
        try:
            info = await asyncio.to_thread(VersionInfo.from_store, self.store, version)
            outcomes = await Distributed(self.pools, plan).update(engines, info)
            for engine, outcome in zip(engines, outcomes, strict=True):
                self.metrics.record(outcome)
                self.copies.forget(engine.engine_id)  # its weights came by broadcast: no local copy
                result = SyncResult(engine.engine_id, version, [outcome], version if outcome.ok else None)
                await self._record_engine(engine, result, version)
        finally:
            self._release(e.engine_id for e in engines)
        await self._advance()
        self.wake()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- reconcile ------------------------------------------------------------------------------
    async def _reconcile_loop(self) -> None:
        await self.adapters.load_routes()
        while True:
            self._wake.clear()
            try:
                await self.reconcile_once()
            except Exception:
                log.exception("reconcile round failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.reconcile_interval_s)

    async def reconcile_once(self) -> None:
        engines = await self.pools.refresh()
        await self.registry.forget_engines(e.engine_id for e in engines)
        if self._trainer_decides:
            async with self._lock:
                await self._apply_unsent()
        elif self.policy.max_lag_ms:
            async with self._lock:
                await self._apply_policy()
        await self._rounds_allowed.wait()
        targets = await self.registry.targets()
        known = await self.registry.engines()
        drained = await self.registry.drained()
        await self._rounds_allowed.wait()
        todo = [e for e in engines if e.engine_id not in self._busy]
        self._claim(e.engine_id for e in todo)
        try:
            await asyncio.gather(*(
                self._converge(e, self.adapters.base_of(targets.for_pool(e.pool)), e.engine_id not in known,
                               e.engine_id in drained)
                for e in todo
            ))  # fmt: skip
            if self.adapters.wanted(targets) or self.adapters.routed:
                await self._adapter_round(todo, targets)
        finally:
            self._release(e.engine_id for e in todo)
        await self._advance()

    async def _adapter_round(self, engines: list[EngineRef], targets: Targets) -> None:
        """Adapters onto the engines that serve their base, routes switched, old adapters unloaded;
        each engine's record then names the adapter version its pool's target is."""
        records = await self.registry.engines()
        bases = {self.adapters.base_of(v) for v in self.adapters.wanted(targets).values()}
        # With no adapter wanted (a rollback to a full version), every serving engine sheds its adapters.
        ready = [e for e in engines if e.engine_id in records and records[e.engine_id].state == "serving"
                 and (not bases or records[e.engine_id].policy_version in bases)]  # fmt: skip
        result = await self.adapters.reconcile(ready, targets)
        for version, reason in result.refused.items():
            if all(version not in held for held in result.held.values()):
                await self._reject(version, reason)
        await self._record_adapters(ready, targets, records, result)

    async def _record_adapters(self, engines: list[EngineRef], targets: Targets, records: dict,
                               result: AdapterRound) -> None:
        for engine in engines:
            target = targets.for_pool(engine.pool)
            if not self.adapters.is_adapter(target):
                continue
            record = broker_pb2.EngineVersion()
            record.CopyFrom(records[engine.engine_id])
            record.target_version = target
            serving = target in result.held.get(engine.engine_id, set()) and target in result.routes.values()
            record.state = "serving" if serving else "behind"
            if serving:
                record.policy_version = target
            await self.registry.put_engine(record)

    async def _converge(self, engine: EngineRef, target: int | None, new: bool, drained: bool) -> None:
        """Brings one engine to `target` (or just records what it serves when there is none)."""
        try:
            current_text = await self.pools.client(engine).weight_version()
        except EngineError as exc:
            self.adapters.forget(engine.engine_id)
            await self._record_engine(engine, SyncResult(engine.engine_id, target or -1), target,
                                      down=str(exc))
            return
        current = parse_version(current_text)
        if current is not None and current == target and not await self._same_run(engine, current):
            current = None  # the same number, of another run's store
        if target is not None and current != target and target in self.trainer_syncs.unstored:
            return  # served straight from the trainer before the store has it: nothing to load yet
        if target is None or current == target:
            await self._record_engine(engine, SyncResult(engine.engine_id, target or -1, serving=current),
                                      target)
            if target is not None and engine.draining and (drained or new):
                await self._undrain(engine, target)
            elif drained and engine.gateway_state == "healthy":
                await self.registry.mark_drained(engine.engine_id, False)  # un-drained by someone else
            return
        refused = self._refused.get(engine.engine_id)
        if refused and refused[0] == target and time.monotonic() < refused[1]:
            return
        if self.gateway is not None and self.config.sync.drain_stale_engines and not drained:
            drained = await self._drain_for_catch_up(self.gateway, engine, current_text, target, new)
        log.info("engine %s: %s -> %d", engine.engine_id, current_text, target)
        await self._record_engine(engine, SyncResult(engine.engine_id, target, serving=current), target,
                                  syncing=True)  # fmt: skip
        result = await self.rollout.sync(engine, current, target)
        self.adapters.forget(engine.engine_id)  # new base weights: adapters are loaded again
        await self._record_engine(engine, result, target)
        if result.ok:
            self._refused.pop(engine.engine_id, None)
            if drained:
                await self._undrain(engine, target)
        elif (refusal := result.full_refused) is not None:
            await self._full_refused(engine, target, refusal)

    async def _drain_for_catch_up(self, gateway: GatewayLink, engine: EngineRef, current_text: str,
                                  target: int, new: bool) -> bool:
        """Whether the broker un-drains this engine once it serves its target: a new engine, or one on
        weights that are no version of this run (restarted), is kept out of traffic until then. One an
        operator drained (known to the broker, on a version of this run) is left as it is."""
        if not (new or parse_version(current_text) is None):
            return False
        if not engine.draining:
            reason = f"catching up from weights {current_text!r} to version {target}"
            if not await gateway.set_draining(engine.engine_id, True, reason):
                if not new:
                    return False
        await self.registry.mark_drained(engine.engine_id, True)
        return True

    async def _same_run(self, engine: EngineRef, version: int) -> bool:
        """Whether an engine reporting `version` holds this run's version rather than the same number of
        another run: the CPU engine names the store directory it loaded (`weight_store_path`). Engines
        that name none (SGLang; weights that came by broadcast) are taken at their word."""
        try:
            path = (await self.pools.client(engine).model_info()).get("weight_store_path")
        except EngineError:
            return True  # judged on the next round
        # Compared by run and version directory names: engines may mount the store elsewhere.
        return not path or Path(path).parts[-2:] == self.store.path(version).parts[-2:]

    async def _undrain(self, engine: EngineRef, version: int) -> None:
        if self.gateway is not None and await self.gateway.set_draining(
            engine.engine_id, False, f"serves version {version}", version
        ):
            await self.registry.mark_drained(engine.engine_id, False)
            log.info("engine %s serves %d: back to HEALTHY", engine.engine_id, version)

    async def _full_refused(self, engine: EngineRef, version: int, outcome: UpdateOutcome) -> None:
        """No engine serves the version and one could not load it in full: the store cannot give the
        trainer's weights, so the version is rejected and its pools fall back. If other engines serve
        it, this engine is the problem: it is left alone for a while."""
        self._refused[engine.engine_id] = (version, time.monotonic() + RETRY_REFUSED_S)
        serving = [r for r in (await self.registry.engines()).values() if r.policy_version == version]
        if serving:
            log.error("engine %s cannot load version %d that %d engines serve: %s",
                      engine.engine_id, version, len(serving), outcome.message)  # fmt: skip
            return
        await self._reject(version, f"engine {engine.engine_id} cannot load it: {outcome.message}")

    async def _reject(self, version: int, reason: str) -> None:
        """The version cannot be served as the trainer wrote it: REJECTED, and its pools fall back."""
        async with self._lock:
            record = await self.registry.get(version)
            if record is None or record.state in (State.VERSION_STATE_REJECTED,
                                                  State.VERSION_STATE_ROLLED_BACK):
                return
            await self.registry.set_state(record, State.VERSION_STATE_REJECTED, reason)
            targets = await self.registry.targets()
            changes: dict[str, int | None] = {}
            if targets.fleet == version:
                changes["fleet"] = await self.registry.newest_in_state({State.VERSION_STATE_ACCEPTED},
                                                                       below=version)
            if targets.candidate == version:
                changes["candidate"] = None  # back to the fleet's target
            if targets.canary == version:
                fallback = await self.registry.newest_in_state(SERVED, below=version)
                fleet = changes.get("fleet", targets.fleet)
                changes["canary"] = max((v for v in (fallback, fleet) if v is not None), default=None)
            await self.registry.set_targets(**changes)
            log.error("version %d rejected (%s); targets now %s", version, reason, changes)
        self.wake()

    async def _record_engine(
        self, engine: EngineRef, result: SyncResult, target: int | None, down: str = "", syncing: bool = False
    ) -> None:
        previous = await self.registry.engine(engine.engine_id) or broker_pb2.EngineVersion()
        record = broker_pb2.EngineVersion()
        record.CopyFrom(previous)
        updates, fallbacks = self._counts.get(engine.engine_id, (0, 0))
        updates += sum(1 for o in result.outcomes if o.ok)
        fallbacks += int(result.fallback)
        self._counts[engine.engine_id] = (updates, fallbacks)
        record.engine_id, record.pool, record.url = engine.engine_id, engine.pool, engine.url
        record.target_version = -1 if target is None else target
        record.updates, record.fallbacks = updates, fallbacks
        record.transport = TRANSPORTS[transport_of(self.config.sync, engine.engine_id, engine.transport)]
        if down:
            record.state, record.last_error = "down", down
        else:
            record.policy_version = -1 if result.serving is None else result.serving
            record.state = "serving" if target is None or result.serving == target else (
                "syncing" if syncing else "behind")
        last = result.last
        if last is not None:
            record.last_transport = TRANSPORTS[last.transport]
            record.last_error = "" if last.ok else last.message
            ok = [o for o in result.outcomes if o.ok]
            if ok:
                record.last_pause_s = sum(o.pause_s for o in ok)
                record.last_bytes = sum(o.bytes for o in ok)
        await self.registry.put_engine(record)

    async def _advance(self) -> None:
        """Version states that follow from what the engines serve: CANARY (and auto-promotion),
        and when the whole fleet first serves its target."""
        async with self._lock:
            targets = await self.registry.targets()
            engines = await self.registry.engines()
            live = self.pools.engines
            by_pool = {p: [r for r in engines.values() if r.pool == p and r.engine_id in live]
                       for p in ("canary", "fleet")}
            promoted = None
            served = {r.policy_version for r in by_pool["canary"] if r.policy_version >= 0}
            # An adapter candidate is served beside the accepted one on every engine: it is the
            # canary once the gateway routes the canary role to it.
            if targets.canary is not None and self.adapters.routed.get("canary") == targets.canary:
                served.add(targets.canary)
            for served_version in sorted(served):
                record = await self.registry.get(served_version)
                # A target the canary reached as the next one was announced was marked SKIPPED
                # (superseded) while it loaded: served all the same, so it is promotable.
                if record is None or record.state not in (State.VERSION_STATE_ANNOUNCED,
                                                          State.VERSION_STATE_SKIPPED):
                    continue
                await self.registry.set_state(record, State.VERSION_STATE_CANARY, "served by the canary pool")
                if self.config.auto_promote and served_version == targets.canary:
                    await self._accept(served_version, "auto_promote")
                    promoted = served_version
            version = targets.fleet if by_pool["fleet"] else targets.canary
            pool = by_pool["fleet"] or by_pool["canary"]
            if version is not None and pool and all(r.policy_version == version for r in pool):
                record = await self.registry.get(version)
                if record is not None and not record.fleet_serving_unix_ms:
                    record.fleet_serving_unix_ms = now_ms()
                    await self.registry.put(record)
                    if record.version.created_unix_ms:
                        self.metrics.publish_to_serving.record(
                            max(0.0, (record.fleet_serving_unix_ms - record.version.created_unix_ms) / 1000))
        if promoted is not None:
            self.wake()

    # --- reading --------------------------------------------------------------------------------
    async def status(self) -> broker_pb2.BrokerStatus:
        targets = await self.registry.targets()
        engines = await self.registry.engines()
        accepted = await self.registry.newest_in_state({State.VERSION_STATE_ACCEPTED})
        return broker_pb2.BrokerStatus(
            run_id=self.config.run_id,
            latest_version=_or(targets.latest),
            canary_version=_or(targets.canary),
            accepted_version=_or(targets.fleet if targets.fleet is not None else accepted),
            fleet_version=_or(targets.fleet),
            candidate_version=_or(targets.candidate),
            engines=[engines[k] for k in sorted(engines) if k in self.pools.engines],
            transport=TRANSPORTS[self.policy.transport],
            auto_promote=self.config.auto_promote,
        )

    async def list_versions(self, limit: int) -> list[broker_pb2.VersionRecord]:
        return await self.registry.newest(limit)


def _or(value: int | None) -> int:
    return -1 if value is None else value
