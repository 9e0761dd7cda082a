"""What `rlfleet run` keeps in its run directory so an interrupted run can be resumed.

The platform's own state is already durable there: JetStream's file store (`nats/`: tasks not yet
settled, trajectories not yet acked), Redis's append-only file (`redis/`: sessions, versions, the
broker's targets), the weight store (`weights/`) and the trainer's checkpoints (`checkpoints/`, each
with the ledger of the trajectories it learned from). What only the driver knows goes to
`run_state.json`: the run's record so far, the accepted version and its evaluation, the gate's
position, how many tasks were handed out, and the loop time already spent from the budget.

The driver writes it every few seconds and at every gate decision, atomically (temporary file and
rename), so even a driver killed with SIGKILL leaves a state at most a few seconds old; what it
misses is only bookkeeping (a few trajectories absent from the report), never training data.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlfleet.cli.launcher import flatten_keys
from rlfleet.cli.report import (
    EpisodeRecord,
    EvalResult,
    GateDecision,
    RunRecord,
    StepRecord,
    TrajectoryRecord,
)
from rlfleet.common.errors import StartupError

STATE_FILE = "run_state.json"

# Everything a run writes into its directory; a fresh run removes exactly these and nothing else.
RUN_OUTPUTS = ("nats", "redis", "weights", "checkpoints", "logs", "ready", "suites", "audit_set", "report",
               "platform.json",
               "platform.stopping",
               "summary.json", "report.html", STATE_FILE)

# Keys a resumed run may change: how long it goes on, how it is watched and how its processes are
# supervised. Everything else shapes what is trained and must stay as it was.
RESUMABLE_CHANGES = ("budget", "eval.concurrency", "restart")


@dataclass
class RunState:
    status: str                     # running | interrupted | finished
    config: dict[str, Any]
    attempt: str                    # names this run's tasks on TASKS, stable across resumes
    loop_s: float = 0.0             # loop time spent from the budget
    start_version: int = 0          # trainer version when the run's loop first started
    tasks_published: int = 0
    last_gated: int = 0
    accepted_version: int = 0
    accepted_eval: dict[str, Any] | None = None
    accepted_regression: dict[str, Any] | None = None
    reason: str = ""                # why it stopped, when interrupted
    resumes: list[float] = field(default_factory=list)  # loop time of each resume
    driver_pid: int = 0             # the `rlfleet run` writing this state, and its start time: two
    driver_start: int = 0           # drivers on one run directory would hand out tasks twice
    driven_by: str = "rlfleet run"  # "controller": the controller service drives it, and resumes it on its start
    record: dict[str, Any] = field(default_factory=dict)

    def save(self, run_dir: Path) -> None:
        path = run_dir / STATE_FILE
        tmp = path.with_name(f".{STATE_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(self), default=str))
        tmp.replace(path)

    @classmethod
    def load(cls, run_dir: Path) -> RunState | None:
        path = run_dir / STATE_FILE
        if not path.exists():
            return None
        try:
            return cls(**json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError) as exc:
            raise StartupError(f"{path} is damaged ({exc}); start over with --fresh") from None


def record_from_dict(data: dict[str, Any]) -> RunRecord:
    data = dict(data)
    data["steps"] = [StepRecord(**s) for s in data.get("steps", [])]
    data["evals"] = [EvalResult(**e) for e in data.get("evals", [])]
    data["gate"] = [GateDecision(**g) for g in data.get("gate", [])]
    data["trajectories"] = [TrajectoryRecord(**t) for t in data.get("trajectories", [])]
    data["episodes"] = [EpisodeRecord(**e) for e in data.get("episodes", [])]
    data["cpu"] = [tuple(c) for c in data.get("cpu", [])]
    data["memory_mb"] = [tuple(m) for m in data.get("memory_mb", [])]
    return RunRecord(**data)


def eval_from_dict(data: dict[str, Any] | None) -> EvalResult | None:
    return EvalResult(**data) if data else None


def config_changes(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Keys whose change would make a resumed run a different run."""

    old, new = dict(flatten_keys(before)), dict(flatten_keys(now))
    changed = []
    for key in sorted(set(old) | set(new)):
        if any(key == k or key.startswith(k + ".") for k in RESUMABLE_CHANGES):
            continue
        if old.get(key) != new.get(key):
            changed.append(f"{key}: {old.get(key)!r} -> {new.get(key)!r}")
    return changed


def clear_run_outputs(run_dir: Path) -> list[str]:
    """Removes what an earlier run wrote (only the names a run writes); returns what was removed."""
    removed = []
    for name in RUN_OUTPUTS:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed
