"""The run the controller drives: started, watched, stopped, and continued after a restart.

    StartRun  -> a RunConfig checked against this controller's run directory; the run directory
                 taken over (new, resumed, or refused as rlfleet run refuses it); the loop started
    the loop  -> rlfleet's RL loop (rlfleet.cli.rl_loop.RLRun) attached to the platform the
                 launcher (or compose, or Kubernetes) supervises; its progress lines go to ProgressLog
    WatchRun  -> the lines from a given one on, then the end
    StopRun   -> an orderly stop: the loop checkpoints and is recorded as interrupted (resumable)

Recovery: the run's state (`driven_by = "controller"`) is saved every few seconds and at every gate
decision to the platform's store (JetStream KV, state_store.py), which the controller claims when
it starts or resumes a run and holds by a lease it renews. A controller started again, on this
machine or another, with this run directory or another, finds a state a controller was driving
still marked running (or interrupted only by its controller's stop) and resumes it
(`resume_on_start`), at once when the previous holder's process is gone from this machine, else
once its lease lapsed: JetStream deduplicates the tasks handed out again, and the trainer's ledger
keeps any trajectory from being trained twice. A controller whose run was taken over stops driving.
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
from rlfleet.common.config import format_validation_error
from rlfleet.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, StartupError
from rlfleet.controller.metrics import ControllerMetrics
from rlfleet.controller.state_store import RunHeld, RunStore, RunTakenOver, Snapshot, StateUnavailable

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
    """At most one run at a time, driven on the platform of `run_dir`, its state in `store`."""

    def __init__(self, run_dir: Path, run_id: str, store: RunStore, platform: PlatformView | None = None,
                 keep_lines: int = 5000, metrics: ControllerMetrics | None = None) -> None:
        self.run_dir = run_dir.resolve()
        self.store = store
        self.platform = platform  # None: the launch record in the run directory says where it is
        self.run_id = run_id
        self.keep_lines = keep_lines
        self.metrics = metrics or ControllerMetrics()
        self.run: RLRun | None = None
        self.progress = ProgressLog(keep_lines)
        self.task: asyncio.Task | None = None
        self.lease: asyncio.Task | None = None
        self.failure = ""  # the error that ended the last run, when one did
        self._starting = asyncio.Lock()  # one decision on the run at a time (StartRun, the resume on start)

    def active(self) -> bool:
        return self.task is not None and not self.task.done()

    # -- starting -------------------------------------------------------------------------------

    async def begin(self, resume: bool, configured: RunConfig | None) -> None:
        """On the service's start: the run a controller was driving when it stopped is continued
        (waiting while another controller holds it), else the configured run is started."""
        said = ""
        while True:
            try:
                if not (resume and await self.resume_on_start()) and configured is not None:
                    await self.start_configured(configured)
                return
            except RunHeld as exc:
                if exc.details["holder"] != said:  # once per holder
                    log.warning("waiting for the run: %s", exc)
                    said = exc.details["holder"]
                await self.store.wait_until_free()
            except StateUnavailable as exc:
                log.warning("cannot read the run's state yet: %s", exc)
                await asyncio.sleep(2.0)
            except FailedPrecondition as exc:
                log.error("the run was not started: %s", exc)
                return

    async def resume_on_start(self) -> bool:
        """Continues the run a controller was driving when it stopped, if the stored state says so."""
        async with self._starting:
            if self.active():
                return True
            snapshot = await self.store.read()
            if snapshot.damaged:
                log.error("cannot resume on start: %s", snapshot.damaged)
                return False
            state = snapshot.state
            stopped_with_it = state is not None and state.status == "interrupted" \
                and state.reason == CONTROLLER_STOPPED
            driving = state is not None and state.driven_by == "controller" and (
                state.status == "running" or stopped_with_it)
            if state is None or not driving:
                return False
            # The run as it was configured, in this controller's run directory (which may be another).
            config = RunConfig.model_validate({**state.config, "run_dir": str(self.run_dir)})
            await self._start(config, resume=True, fresh=False, how="resumed", snapshot=snapshot)
            return True

    def configured_run(self, path: str) -> RunConfig:
        """The run of a config file (TOML, `rlfleet run`'s format), checked as StartRun checks it."""
        import tomllib

        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise StartupError(f"start_run {path}: {exc}") from None
        return self.parse_config(json.dumps(data))

    async def start_configured(self, config: RunConfig) -> None:
        """Starts the configured run unless the store holds that run finished, or one to resume or
        discard (said in the log)."""
        async with self._starting:
            snapshot = await self.store.read()
            state = snapshot.state
            if state is not None and state.status == "finished" \
                    and state.config.get("run_id") == config.run_id:
                log.info("start_run: run %s is finished; nothing to start", config.run_id)
                return
            try:
                await self._start(config, resume=False, fresh=False, how="configured", snapshot=snapshot)
            except RunHeld:
                raise
            except FailedPrecondition as exc:
                log.error("start_run: %s", exc)

    def parse_config(self, config_json: str) -> RunConfig:
        try:
            data = json.loads(config_json or "{}")
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"config_json is not JSON: {exc}", field="config_json") from None
        if not isinstance(data, dict):
            raise InvalidArgument("config_json must be a JSON object of RunConfig fields",
                                  field="config_json")
        # No run_dir (a config that names none, as examples/*.toml) is this controller's own: a client
        # cannot know where the controller's working directory resolves a relative one.
        if not data.get("run_dir"):
            data["run_dir"] = str(self.run_dir)
        data.setdefault("run_id", self.run_id)
        try:
            config = RunConfig.model_validate(data)
        except ValidationError as exc:
            raise InvalidArgument(f"config_json: {format_validation_error(exc)}",
                                  field="config_json") from None
        if Path(config.run_dir).resolve() != self.run_dir:
            raise InvalidArgument(f"the run's run_dir {config.run_dir!r} is not this controller's "
                                  f"({self.run_dir})", field="config_json.run_dir", run_dir=str(self.run_dir))
        if config.run_id != self.run_id:
            raise InvalidArgument(f"the run's run_id {config.run_id!r} is not this platform's "
                                  f"({self.run_id!r})", field="config_json.run_id", run_id=self.run_id)
        return config

    async def start(self, config: RunConfig, *, resume: bool, fresh: bool, how: str = "") -> RLRun:
        async with self._starting:
            return await self._start(config, resume=resume, fresh=fresh, how=how)

    async def _start(self, config: RunConfig, *, resume: bool, fresh: bool, how: str,
                     snapshot: Snapshot | None = None) -> RLRun:
        """Takes the run over as `rlfleet run` would (new, resumed, or refused), claims it in the
        store (refused while another controller holds it) and starts the loop."""
        if self.active():
            raise AlreadyExists(f"run {self.run_id!r} is already being driven here; WatchRun follows it, "
                                "StopRun stops it", run_id=self.run_id)
        snapshot = snapshot or await self.store.read()
        if snapshot.damaged and not fresh:
            raise FailedPrecondition(f"{snapshot.damaged} (StartRun with fresh, `rlfleet run --fresh`)",
                                     run_id=self.run_id)
        self.store.check_free(snapshot)
        progress = ProgressLog(self.keep_lines)
        run = RLRun(config, RunOptions(resume=resume, fresh=fresh, attach_only=True), output=progress.add,
                    platform=self.platform, sink=self.store)
        try:
            run.run_dir.mkdir(parents=True, exist_ok=True)
            run.take_over(None if snapshot.damaged else snapshot.state, snapshot.where)
        except (StartupError, OSError) as exc:
            raise FailedPrecondition(str(exc), run_dir=str(self.run_dir)) from None
        await self.store.claim(run.current_state(), snapshot)
        holder = snapshot.head.owner if snapshot.head is not None else None
        if run.resuming and holder is not None and holder.id != self.store.owner.id:
            progress.add(f"state: continued from {holder.describe()} ({self.store.where})")
        self.run, self.progress, self.failure = run, progress, ""
        self.metrics.runs.add(1, {"how": how or ("resumed" if resume else "started")})
        self.task = asyncio.create_task(self._drive(run, progress), name="the run")
        self.lease = asyncio.create_task(self._keep_lease(run, self.task), name="the run's lease")
        return run

    async def _keep_lease(self, run: RLRun, task: asyncio.Task) -> None:
        """Renews this controller's lease on the run until the run ends; a run another controller
        took over (this one's lease had lapsed) is stopped: it hands out nothing more."""
        every = self.store.config.lease_s / 3
        while not task.done():
            await asyncio.wait({task}, timeout=every)
            if task.done():
                return
            try:
                await self.store.renew()
            except RunTakenOver as exc:
                run.interrupted = run.interrupted or str(exc)
                run.say(f"stopping: {exc}")
                run.stop.set()
                return
            except StateUnavailable as exc:  # NATS restarting: the next round tries again
                log.warning("the run's lease was not renewed: %s", exc)
            except Exception as exc:  # said, and tried again next round: the lease must not stop in silence
                log.error("renewing the run's lease failed", exc_info=exc)

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
        if self.lease is not None:
            self.lease.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.lease

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
