"""The sync policy: which announced version goes to the canary pool, and when.

A version is synced when it is at least `every_n_versions` past the last synced one; when
`max_lag_s` is set, the newest waiting version is also synced once the oldest waiting one has
waited that long, so that a trainer that slows down never leaves engines behind for good. The
waiting versions older than the synced one are skipped. Pure logic: no I/O, unit-tested alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rlfleet.broker.config import SyncConfig


@dataclass(frozen=True)
class SyncDecision:
    version: int | None  # the version to sync now, if any
    skipped: tuple[int, ...]  # waiting versions passed over
    reason: str


class SyncPolicy:
    def __init__(self, config: SyncConfig) -> None:
        self.every_n = config.every_n_versions
        self.max_lag_ms = int(config.max_lag_s * 1000)
        self.transport = config.transport

    def decide(self, last_synced: int | None, waiting: Mapping[int, int], now_ms: int) -> SyncDecision:
        """`waiting`: announced, not yet synced versions -> their announce time (unix ms)."""
        stale = tuple(sorted(v for v in waiting if last_synced is not None and v <= last_synced))
        fresh = sorted(v for v in waiting if last_synced is None or v > last_synced)
        if not fresh:
            return SyncDecision(None, stale, "nothing newer than the last synced version")
        newest = fresh[-1]
        if last_synced is None:
            reason = "first version"
        elif newest - last_synced >= self.every_n:
            reason = (f"{newest - last_synced} versions past the last synced one "
                      f"(every_n_versions={self.every_n})")
        elif self.max_lag_ms and now_ms - waiting[fresh[0]] >= self.max_lag_ms:
            reason = f"version {fresh[0]} waited {(now_ms - waiting[fresh[0]]) / 1000:.1f}s (max_lag_s)"
        else:
            return SyncDecision(None, stale,
                                f"waiting: {newest - last_synced} of every_n_versions={self.every_n}")
        return SyncDecision(newest, stale + tuple(fresh[:-1]), reason)

    def next_deadline_ms(self, last_synced: int | None, waiting: Mapping[int, int]) -> int | None:
        """When `decide` may first say yes by lag alone (None: never, or already due)."""
        fresh = [t for v, t in waiting.items() if last_synced is None or v > last_synced]
        if not self.max_lag_ms or not fresh:
            return None
        return min(fresh) + self.max_lag_ms
