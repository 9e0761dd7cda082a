"""The run the controller drives: started, watched, stopped, and continued after a restart.

    StartRun  -> a RunConfig checked against this controller's run directory; the run directory
                 taken over (new, resumed, or refused as rlfleet run refuses it); the loop started
    the loop  -> rlfleet's RL loop (rlfleet.cli.rl_loop.RLRun) attached to the platform the
                 launcher (or compose, or Kubernetes) supervises; its progress lines go to ProgressLog
    WatchRun  -> the lines from a given one on, then the end
    StopRun   -> an orderly stop: the loop checkpoints and is recorded as interrupted (resumable)

Recovery: the run's state (run_state.json, `driven_by = "controller"`) is saved every few seconds
and at every gate decision. A controller started again finds a state it was driving still marked
running (or interrupted only by its own stop) and resumes it (`resume_on_start`): JetStream deduplicates the tasks handed out again, and
the trainer's ledger keeps any trajectory from being trained twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from pydantic import ValidationError

from rlfleet.api.controller.v1 import controller_pb2
from rlfleet.cli.rl_loop import PlatformView, RLRun, RunOptions
from rlfleet.cli.run_config import RunConfig
from rlfleet.cli.run_state import RunState
from rlfleet.common.config import format_validation_error
from rlfleet.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, StartupError
from rlfleet.controller.metrics import ControllerMetrics

log = logging.getLogger(__name__)
STOPPED_BY_REQUEST = "stopped by a request"
CONTROLLER_STOPPED = "the controller stopped"  # its service was stopped: the next start goes on


class ProgressLog:
    """The run's progress lines, numbered from 0, the last `keep` of them held for watchers."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.first = 0  # number of the oldest line held
        self.lines: list[str] = []
        self.ended = False
        self._changed = asyncio.Event()

    @property
    def count(self) -> int:
        return self.first + len(self.lines)

    def add(self, text: str) -> None:
        log.info("run: %s", text)
        self.lines.extend(text.splitlines() or [""])
        if len(self.lines) > self.keep:
            drop = len(self.lines) - self.keep
            del self.lines[:drop]
            self.first += drop
        self._wake()

    def end(self) -> None:
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, from_line: int) -> AsyncIterator[tuple[int, str]]:
        """(number, line) from `from_line` on (or the oldest held), until the run ended."""
        n = max(from_line, self.first)
        while True:
            while n < self.count:
                yield n, self.lines[n - self.first]
                n = max(n + 1, self.first)
            if self.ended:
                return
            await self._changed.wait()


class RunControl:
    """At most one run at a time, driven on the platform of `run_dir`."""

    def __init__(self, run_dir: Path, run_id: str, platform: PlatformView | None = None, keep_lines: int = 5000,
                 metrics: ControllerMetrics | None = None) -> None:
        self.run_dir = run_dir.resolve()
        self.platform = platform  # None: the launch record in the run directory says where it is
        self.run_id = run_id
        self.keep_lines = keep_lines
        self.metrics = metrics or ControllerMetrics()
        self.run: RLRun | None = None
        self.progress = ProgressLog(keep_lines)
        self.task: asyncio.Task | None = None
        self.failure = ""  # the error that ended the last run, when one did

    def active(self) -> bool:
        return self.task is not None and not self.task.done()

    # -- starting -------------------------------------------------------------------------------

    def resume_on_start(self) -> bool:
        """Continues the run this controller was driving when it stopped, if the state says so."""
        try:
            state = RunState.load(self.run_dir)
        except StartupError as exc:
            log.error("cannot resume on start: %s", exc)
            return False
        driving = state is not None and state.driven_by == "controller" and (
            state.status == "running" or (state.status == "interrupted" and state.reason == CONTROLLER_STOPPED))
        if state is None or not driving:
            return False
        config = RunConfig.model_validate(state.config)
        self.start(config, resume=True, fresh=False, how="resumed")
        return True

    def start_configured(self, path: str) -> None:
        """Starts the run of a config file (TOML, `rlfleet run`'s format) unless the run directory
        already holds that run finished, or one to resume or discard (said in the log)."""
        import tomllib

        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise StartupError(f"start_run {path}: {exc}") from None
        config = self.parse_config(json.dumps(data))
        try:
            state = RunState.load(self.run_dir)
        except StartupError as exc:
            log.error("start_run: %s", exc)
            return
        if state is not None and state.status == "finished" and state.config.get("run_id") == config.run_id:
            log.info("start_run: the run in %s is finished; nothing to start", self.run_dir)
            return
        try:
            self.start(config, resume=False, fresh=False, how="configured")
        except FailedPrecondition as exc:
            log.error("start_run: %s", exc)

    def parse_config(self, config_json: str) -> RunConfig:
        try:
            data = json.loads(config_json or "{}")
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"config_json is not JSON: {exc}", field="config_json") from None
        if not isinstance(data, dict):
            raise InvalidArgument("config_json must be a JSON object of RunConfig fields", field="config_json")
        data.setdefault("run_dir", str(self.run_dir))
        data.setdefault("run_id", self.run_id)
        try:
            config = RunConfig.model_validate(data)
        except ValidationError as exc:
            raise InvalidArgument(f"config_json: {format_validation_error(exc)}", field="config_json") from None
        if Path(config.run_dir).resolve() != self.run_dir:
            raise InvalidArgument(f"the run's run_dir {config.run_dir!r} is not this controller's ({self.run_dir})",
                                  field="config_json.run_dir", run_dir=str(self.run_dir))
        if config.run_id != self.run_id:
            raise InvalidArgument(f"the run's run_id {config.run_id!r} is not this platform's ({self.run_id!r})",
                                  field="config_json.run_id", run_id=self.run_id)
        return config

    def start(self, config: RunConfig, *, resume: bool, fresh: bool, how: str = "") -> RLRun:
        if self.active():
            raise AlreadyExists(f"run {self.run_id!r} is already being driven here; WatchRun follows it, "
                                "StopRun stops it", run_id=self.run_id)
        progress = ProgressLog(self.keep_lines)
        run = RLRun(config, RunOptions(resume=resume, fresh=fresh, attach_only=True), output=progress.add,
                    platform=self.platform)
        try:
            run.take_over_run_dir()
        except StartupError as exc:
            raise FailedPrecondition(str(exc), run_dir=str(self.run_dir)) from None
        self.run, self.progress, self.failure = run, progress, ""
        self.metrics.runs.add(1, {"how": how or ("resumed" if resume else "started")})
        self.task = asyncio.create_task(self._drive(run, progress), name="the run")
        return run

    async def _drive(self, run: RLRun, progress: ProgressLog) -> None:
        try:
            await run.run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # said on the run's lines and in the log; the state says interrupted
            self.failure = f"{type(exc).__name__}: {exc}"
            progress.add(f"the run failed: {self.failure}")
            log.error("the run failed", exc_info=exc)
        finally:
            self.metrics.ends.add(1, {"status": self.status()})
            progress.end()

    # -- stopping -------------------------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        if self.run is None:
            raise NotFound("no run has been started here", run_id=self.run_id)
        if self.active():
            self.run.interrupted = self.run.interrupted or reason or STOPPED_BY_REQUEST
            self.run.say("stopping (a StopRun request) ...")
            self.run.stop.set()

    async def close(self, timeout_s: float = 120.0) -> None:
        """On the service's stop: the run stops in order (a restarted controller resumes it)."""
        if self.run is not None and self.active():
            # Checkpointed and saved as interrupted by this reason, which the next start resumes.
            self.run.interrupted = self.run.interrupted or CONTROLLER_STOPPED
            self.run.stop.set()
        if self.task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(self.task), timeout_s)
            if not self.task.done():
                self.task.cancel()

    # -- what it looks like ---------------------------------------------------------------------

    def status(self) -> str:
        run = self.run
        if run is None:
            return ""
        if self.active():
            return "running" if run.loop_started else "starting"
        if self.failure:
            return "failed"
        return "interrupted" if run.interrupted else "finished"

    def info(self) -> controller_pb2.RunInfo:
        run = self.run
        if run is None:
            raise NotFound("no run has been started here", run_id=self.run_id)
        return controller_pb2.RunInfo(
            run_id=run.config.run_id, status=self.status(), reason=run.interrupted or self.failure,
            loop_s=run.clock.elapsed() if run.loop_started and self.active() else run.state.loop_s,
            accepted_version=run.record.accepted_version, steps=len(run.record.steps),
            gate_decisions=len(run.record.gate), run_dir=str(self.run_dir), driven_by=run.state.driven_by,
            resumes=len(run.state.resumes), lines=self.progress.count)
