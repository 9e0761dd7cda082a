"""What the run's driver keeps so an interrupted run can be resumed: `RunState`, and where it goes.

The platform's own state is already durable: JetStream's file store (tasks not yet settled,
trajectories not yet acked), Redis's append-only file (sessions, versions, the broker's targets), the
weight store and the trainer's checkpoints (each with the ledger of the trajectories it learned from).
What only the driver knows is the `RunState`: the run's record so far, the accepted version and its
evaluation, the gate's position, how many tasks were handed out, and the loop time already spent
from the budget.

The driver (the controller) saves it every few seconds and at every gate decision through a
`StateSink`: the controller's is the platform's store (JetStream KV, rlfleet.controller.state_store),
so a controller started on any machine continues the run; it also writes the same state to the run
directory's `run_state.json` (`RunDirFile`), which is what `rlfleet run` reads before its platform
(and so its NATS) is up, to refuse or resume, and what `rlfleet status` shows the stop rules from.
Each save is atomic (a KV head swapped by revision; the file by temporary file and rename), so even
a controller killed with SIGKILL leaves a state at most a few seconds old; what it misses is only
bookkeeping (a few trajectories absent from the report), never training data.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Protocol

from rlfleet.cli.launcher import flatten_keys, start_ticks
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
# supervised, where the driver keeps its files (a controller started on another machine continues
# the run in a run directory of its own) and how it keeps the run's state (its lease, parts, copy).
# Everything else shapes what is trained and must stay as it was.
RESUMABLE_CHANGES = ("budget", "eval.concurrency", "restart", "run_dir", "controller.state")


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
    driver_pid: int = 0             # the driver writing this state, its start time and the machine (and
    driver_start: int = 0           # PID namespace) it runs on: two drivers of one run would hand out
    driver_host: str = ""           # tasks twice ("": a state from before hosts were recorded, local)
    # "controller": the controller service drives it, and resumes it on its start
    driven_by: str = "rlfleet run"
    # The seed of the run's seeded evaluations (`eval.seed`, or drawn at its start); None: a state saved
    # before runs had their own, whose evaluations were seeded by the config's `seed`.
    eval_seed: int | None = None
    record: dict[str, Any] = field(default_factory=dict)   # the run's record, as a saved state holds it
    # The live record already as JSON (`RecordJSON`): what `to_json` writes as `record` when set.
    record_json: str | None = field(default=None, compare=False, repr=False)

    def evaluation_seed(self) -> int:
        """The seed the run's seeded evaluations use (a state from before runs had their own: `seed`)."""
        return int(self.config.get("seed", 0)) if self.eval_seed is None else self.eval_seed

    def to_json(self) -> str:
        head = {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("record", "record_json")}
        record = self.record_json if self.record_json is not None else json.dumps(self.record, default=str)
        return json.dumps(head, default=str)[:-1] + ', "record": ' + record + "}"

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> RunState:
        try:
            return cls(**json.loads(text))
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as exc:
            raise StartupError(f"{where} is damaged ({exc}); start over with --fresh") from None

    def save(self, run_dir: Path, text: str | None = None) -> None:
        """Writes run_state.json atomically; `text` is this state's JSON when the caller has it."""
        path = run_dir / STATE_FILE
        tmp = path.with_name(f".{STATE_FILE}.{os.getpid()}.tmp")
        tmp.write_text(self.to_json() if text is None else text)
        tmp.replace(path)

    @classmethod
    def load(cls, run_dir: Path) -> RunState | None:
        path = run_dir / STATE_FILE
        if not path.exists():
            return None
        return cls.from_json(path.read_text(), str(path))


class StateSink(Protocol):
    """Where a driver saves the run's state (every few seconds, at every gate decision, at its end)."""

    async def save(self, state: RunState) -> None: ...


class RunDirFile:
    """The run directory's run_state.json as a `StateSink`."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir

    async def save(self, state: RunState) -> None:
        state.save(self.run_dir)


def host_identity() -> str:
    """This machine and PID namespace (host name, boot id, PID namespace): a PID and its start time
    say whether a process lives only where this is the same."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    return f"{socket.gethostname()}/{boot}/{pidns}"


def driver_alive(pid: int, start: int, host: str) -> bool | None:
    """Whether the driver process (`pid` started at `start` clock ticks, on `host`) still runs:
    None when it runs elsewhere, where this machine cannot tell. `host` "" is a state written
    before hosts were recorded, by a driver on this machine."""
    if host and host != host_identity():
        return None
    return pid > 0 and start_ticks(pid) == start


# The record's lists that only grow, each item complete when it is appended and never changed after.
APPEND_ONLY = ("steps", "trajectories", "episodes")


class RecordJSON:
    """A RunRecord as JSON, as `json.dumps(asdict(record))` writes it, for a state saved every few
    seconds all run long: each item of the record's append-only lists (thousands of trajectories
    and episodes) is encoded once, not again at every save. Encoding the whole record each time
    was 30% of the controller's CPU two minutes into a vs-TRL loop, and grows with the run."""

    def __init__(self) -> None:
        self._encoded: dict[str, tuple[list, list[str]]] = {}  # list name -> (the list, its items' JSON)

    def encode(self, record: RunRecord) -> str:
        parts = []
        for f in fields(record):
            value = getattr(record, f.name)
            text = ("[" + ", ".join(self._items(f.name, value)) + "]" if f.name in APPEND_ONLY
                    else json.dumps(value, default=_as_json))
            parts.append(f"{json.dumps(f.name)}: {text}")
        return "{" + ", ".join(parts) + "}"

    def _items(self, name: str, items: list) -> list[str]:
        source, done = self._encoded.get(name, (None, []))
        if source is not items or len(done) > len(items):  # another record (a resume): start again
            done = []
        done.extend(json.dumps(asdict(item), default=str) for item in items[len(done):])
        self._encoded[name] = (items, done)
        return done


def _as_json(value: Any) -> Any:
    """What `json.dumps(asdict(record), default=str)` makes of a value JSON cannot encode: a
    dataclass (an EvalResult, a GateDecision) as its asdict, anything else as its str."""
    return asdict(value) if is_dataclass(value) and not isinstance(value, type) else str(value)


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
