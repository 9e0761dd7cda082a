"""The trained-trajectory ledger: which trajectory IDs went into which optimizer step.

It is the trainer's idempotency record and its proof of exactly-once. Each checkpoint writes the
whole ledger of the weights it holds (one JSON line per step: step, version, IDs), so the ledger
of the latest checkpoint lists every trajectory the checkpointed model has learned from, each
exactly once. Steps taken since the last checkpoint are *uncommitted*: their messages stay unacked
until a checkpoint including them is durable, and a crash forgets them on both sides (weights and
ledger) while JetStream redelivers their messages.

Memory and checkpoint size grow with the number of trajectories trained (an ID is ~40 bytes);
a run of millions of trajectories would compact old steps into a stream-sequence watermark.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class StepRecord:
    step: int
    version: int
    ids: tuple[str, ...]


class TrainedLedger:
    def __init__(self, committed: list[StepRecord] | None = None) -> None:
        self.committed: list[StepRecord] = list(committed or [])
        self.uncommitted: list[StepRecord] = []
        self._durable = {i for r in self.committed for i in r.ids}
        self._pending: set[str] = set()

    def __contains__(self, trajectory_id: str) -> bool:
        return trajectory_id in self._durable or trajectory_id in self._pending

    def is_durable(self, trajectory_id: str) -> bool:
        return trajectory_id in self._durable

    @property
    def trained_count(self) -> int:
        return len(self._durable) + len(self._pending)

    def record(self, step: int, version: int, ids: list[str]) -> None:
        again = [i for i in ids if i in self]
        if again:
            raise ValueError(f"step {step} would train {len(again)} trajectories a second "
                             f"time, e.g. {again[0]}")
        self.uncommitted.append(StepRecord(step, version, tuple(ids)))
        self._pending.update(ids)

    def records(self) -> list[StepRecord]:
        """Every step of the current weights, committed or not: what a checkpoint of them writes."""
        return self.committed + self.uncommitted

    def commit(self) -> list[str]:
        """Marks the uncommitted steps durable (their checkpoint is on disk); returns their IDs."""
        ids = [i for r in self.uncommitted for i in r.ids]
        self.committed += self.uncommitted
        self.uncommitted = []
        self._durable.update(ids)
        self._pending.clear()
        return ids

    # ------------------------------------------------------------ files

    @staticmethod
    def write(path: Path, records: list[StepRecord]) -> None:
        with open(path, "w") as f:
            for r in records:
                f.write(json.dumps({**asdict(r), "ids": list(r.ids)}) + "\n")

    @classmethod
    def read(cls, path: Path) -> TrainedLedger:
        records = []
        for line in path.read_text().splitlines():
            if line.strip():
                d = json.loads(line)
                records.append(StepRecord(int(d["step"]), int(d["version"]), tuple(d["ids"])))
        return cls(records)
