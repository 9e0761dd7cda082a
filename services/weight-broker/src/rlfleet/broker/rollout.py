"""Bringing one engine from the version it serves to its pool's target.

The plan: deltas, one after the other, when the engine holds a version of this run at most
`max_delta_chain` store versions behind the target along the delta chain (and the transport is
not disk_full); otherwise one full load. A delta the engine refuses (corrupt or missing payload,
base version mismatch, preverify failure: the engine changed nothing) falls back to a full load of
the target. A full load the engine refuses means the target cannot be served as the trainer wrote
it; the broker decides what that means for the version (see `Broker`). Going back (rollback) is
always a full load. The distributed transport is driven by the trainer's broadcast; engines that
miss one catch up here, from the store.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from rlfleet.broker.config import SyncConfig, transport_of
from rlfleet.broker.metrics import BrokerMetrics
from rlfleet.broker.pools import EngineRef, GatewayLink, Pools
from rlfleet.broker.transports import DiskDelta, DiskFull, Pauser, UpdateOutcome, VersionInfo
from rlfleet.weights import DirectoryWeightStore, WeightStoreError
from rlfleet.weights.local_copy import LocalCopies

log = logging.getLogger(__name__)


@dataclass
class SyncResult:
    engine_id: str
    target: int
    outcomes: list[UpdateOutcome] = field(default_factory=list)
    serving: int | None = None  # the version the engine serves afterwards, when known
    fallback: bool = False

    @property
    def ok(self) -> bool:
        return self.serving == self.target

    @property
    def last(self) -> UpdateOutcome | None:
        return self.outcomes[-1] if self.outcomes else None

    @property
    def full_refused(self) -> UpdateOutcome | None:
        """The last outcome when it is a refused full load (the store cannot give the version), else None."""
        last = self.last
        return last if last is not None and last.transport == "disk_full" and last.refused else None


class Rollout:
    def __init__(
        self,
        store: DirectoryWeightStore,
        pools: Pools,
        gateway: GatewayLink | None,
        metrics: BrokerMetrics,
        config: SyncConfig,
        copies: LocalCopies | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.metrics = metrics
        # The broker-mode weight agent: the full local copies SGLang engines load.
        self.copies = copies
        self.delta = DiskDelta(pools, config.pause_mode, copies)
        self.full = DiskFull(pools, Pauser(pools, gateway), config.pause_mode, copies)

    def plan(self, current: int | None, target: int, transport: str = "") -> list[int]:
        """The deltas to apply in order, or [] for one full load (current == target: nothing to do)."""
        if (transport or self.config.transport) == "disk_full" or current is None or current >= target:
            return []
        chain: list[int] = []
        version = target
        while version != current:
            if len(chain) >= self.config.max_delta_chain:
                return []
            try:
                index = self.store.index(version)
            except WeightStoreError:
                return []  # the full load will say what is wrong
            if index.kind != "delta" or index.base_version is None or index.base_version < current:
                return []
            chain.append(version)
            version = index.base_version
        return chain[::-1]

    async def sync(self, engine: EngineRef, current: int | None, target: int) -> SyncResult:
        result = SyncResult(engine.engine_id, target, serving=current)
        steps = await asyncio.to_thread(self.plan, current, target,
                                        transport_of(self.config, engine.engine_id, engine.transport))
        for version in steps:
            outcome = await self._run(self.delta, engine, version)
            result.outcomes.append(outcome)
            if outcome.ok:
                result.serving = version
                continue
            if not outcome.refused:
                return result  # unreachable: retried on a later reconcile
            log.warning("engine %s refused delta %d (%s); full load of %d instead",
                        engine.engine_id, version, outcome.message, target)  # fmt: skip
            self.metrics.fallbacks.add(1)
            result.fallback = True
            break
        if result.serving == target:
            return result
        outcome = await self._run(self.full, engine, target)
        result.outcomes.append(outcome)
        if outcome.ok:
            result.serving = target
        return result

    async def _run(self, transport: DiskDelta | DiskFull, engine: EngineRef, version: int) -> UpdateOutcome:
        try:
            info = await asyncio.to_thread(VersionInfo.from_store, self.store, version)
        except WeightStoreError as exc:
            info = VersionInfo(version, str(self.store.path(version)), "unknown", None, 0, 0, None)
            log.warning("store index of version %d unreadable: %s", version, exc)
        try:
            (outcome,) = await asyncio.wait_for(transport.update([engine], info),
                                                self.config.update_timeout_s)
        except TimeoutError:
            outcome = UpdateOutcome(engine.engine_id, version, transport.name, False,
                                    message=f"no answer within {self.config.update_timeout_s}s")  # fmt: skip
        self.metrics.record(outcome)
        return outcome
