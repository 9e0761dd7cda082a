"""Atomic, resumable checkpoints of the whole trainer: the backend's state plus the service's.

    <dir>/v00000012/                                              the trainer at policy version 12
        model.safetensors, optimizer.pt, trainer_state.pt, rng/   backend: weights, optimizer, schedule, RNG
        service_state.json                                        step, policy version, counters
        ledger.jsonl                                              trained trajectory IDs, per step
    <dir>/.tmp-v00000013-<pid>/                                   being written; never read

Checkpoints are named by policy version, which every step moves forward (an optimizer step the
backend skipped for a non-finite gradient still consumed its trajectories and makes a version).

A checkpoint is written into a temporary directory, every file and the directory are fsynced, and
one rename makes it visible: a reader (a restarted trainer) sees a whole checkpoint or none.
`service_state.json` is written last, so a directory without it is never taken for a checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlfleet.trainer.ledger import StepRecord, TrainedLedger

log = logging.getLogger(__name__)

STATE_FILE = "service_state.json"
LEDGER_FILE = "ledger.jsonl"
_DIR = re.compile(r"^v(\d{8,})$")


@dataclass
class ServiceState:
    run_id: str
    step: int
    policy_version: int
    parent_version: int
    trained_trajectories: int
    dropped_by_reason: dict[str, int] = field(default_factory=dict)
    created_unix_ms: int = 0


@dataclass
class Restored:
    path: Path
    state: ServiceState
    ledger: TrainedLedger


class Checkpointer:
    def __init__(self, root: str | Path, keep: int = 2) -> None:
        self.root = Path(root)
        self.keep = keep
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, version: int) -> Path:
        return self.root / f"v{version:08d}"

    def save(self, state: ServiceState, records: list[StepRecord],
             write_backend: Callable[[Path], None]) -> Path:
        """Writes a checkpoint of `state` (the backend's part through `write_backend(dir)`) and
        returns its path once it is durable. Idempotent for a version that already has one."""
        final = self.path(state.policy_version)
        if final.exists():
            return final
        tmp = self.root / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write_backend(tmp)
        TrainedLedger.write(tmp / LEDGER_FILE, records)
        state.created_unix_ms = int(time.time() * 1000)
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=1, sort_keys=True))
        _fsync_tree(tmp)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        self._prune()
        return final

    def latest(self) -> Restored | None:
        """The newest complete checkpoint, or None."""
        for path in reversed(self._complete()):
            try:
                data = json.loads((path / STATE_FILE).read_text())
                ledger = TrainedLedger.read(path / LEDGER_FILE)
            except (OSError, ValueError, KeyError) as exc:
                log.warning("checkpoint %s unreadable (%s); trying an older one", path, exc)
                continue
            return Restored(path, ServiceState(**data), ledger)
        return None

    def remove_temporaries(self) -> None:
        """Drops what a crashed writer left behind."""
        for p in self.root.glob(".tmp-v*"):
            shutil.rmtree(p, ignore_errors=True)

    def _complete(self) -> list[Path]:
        found = [(int(m.group(1)), p) for p in self.root.iterdir()
                 if (m := _DIR.match(p.name)) and (p / STATE_FILE).is_file()]
        return [p for _, p in sorted(found)]

    def _prune(self) -> None:
        for old in self._complete()[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
