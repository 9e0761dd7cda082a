"""`rlfleet run CONFIG`: the thin client of the run's controller.

    take over   <- the run directory says: a new run, a resume (--resume), or one to discard (--fresh)
    base policy <- build the default model and SFT-warm-start it (cached)
    platform    <- attached to when it runs in the run directory, else started (the controller with it)
    run         <- StartRun on the controller, which drives the loop (rlfleet.controller)
    watch       <- its progress lines until it ends; meanwhile a platform process that dies is started
                   again on its own ports (the launcher's restart policy) and the run goes on
    end         <- the report (written by the controller into the run directory), the platform down

Ctrl-C asks the controller to stop the run in order (it checkpoints; `--resume` continues it); a
second Ctrl-C stops waiting. A controller that dies is restarted by the launcher and continues the
run from its state; the watch reconnects and goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from pathlib import Path

import grpc
import uvloop

from rlfleet.api.controller.v1 import controller_pb2, controller_pb2_grpc
from rlfleet.cli.launcher import Platform, PlatformState, is_ours, use_run_secrets
from rlfleet.cli.platform_config import PlatformConfig
from rlfleet.cli.rl_loop import RLRun, RunOptions, platform_differences, say
from rlfleet.cli.run_config import RunConfig
from rlfleet.cli.run_state import clear_run_outputs
from rlfleet.cli.warm_start import ensure_base_policy
from rlfleet.common.config import load_config
from rlfleet.common.errors import StartupError
from rlfleet.common.grpc_server import channel

SIGNALLED = "stopped by a signal"
RECONNECT_S = 1.0
CALL_TIMEOUT_S = 10.0
WATCH_CALL_S = 60.0  # one WatchRun call's deadline; the watch goes on with another from the next line
GONE_AFTER_STOP_S = 60.0  # a controller unreachable this long after a stop was asked is not waited for


class Controller:
    """The controller's RunControl API, as `rlfleet run` uses it; a controller restarting is waited for."""

    def __init__(self, address: str) -> None:
        self.channel = channel(address)
        self.stub = controller_pb2_grpc.RunControlStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def _call(self, method, request, within_s: float = 120.0):
        deadline = time.monotonic() + within_s
        while True:
            try:
                return await method(request, timeout=CALL_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) \
                        or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(RECONNECT_S)

    async def start(self, config: RunConfig, options: RunOptions, run_dir: Path) -> controller_pb2.RunInfo:
        """StartRun with the run directory as this client resolved it (absolute: the controller's
        working directory is not this one's)."""
        sent = config.model_copy(update={"run_dir": str(run_dir)})
        request = controller_pb2.StartRunRequest(config_json=json.dumps(sent.model_dump(mode="json")),
                                                 resume=options.resume, fresh=options.fresh)
        try:
            return await self._call(self.stub.StartRun, request)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.ALREADY_EXISTS and options.resume:
                # it resumed on its own
                return await self._call(self.stub.GetRun, controller_pb2.GetRunRequest())
            raise StartupError(f"the controller refused the run: {exc.details()}") from None

    async def stop(self, reason: str) -> None:
        await self._call(self.stub.StopRun, controller_pb2.StopRunRequest(reason=reason), within_s=60.0)

    async def follow(self, show, stopped: asyncio.Event) -> controller_pb2.RunInfo:
        """Shows the run's progress lines until it ends; returns its final state. A controller that
        restarted (fewer lines than seen) is followed from its first line."""
        next_line, unreachable_since = 0, None
        while True:
            try:
                async for event in self.stub.WatchRun(controller_pb2.WatchRunRequest(from_line=next_line),
                                                      timeout=WATCH_CALL_S):
                    if event.ended:
                        return event.run
                    show(event.line)
                    next_line = event.line_number + 1
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                      grpc.StatusCode.CANCELLED, grpc.StatusCode.NOT_FOUND):
                    raise
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    unreachable_since = unreachable_since or time.monotonic()
                    if stopped.is_set() and time.monotonic() - unreachable_since > GONE_AFTER_STOP_S:
                        return controller_pb2.RunInfo(status="interrupted", reason="the controller is gone")
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stopped.wait(), RECONNECT_S)
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        run = await self.stub.GetRun(controller_pb2.GetRunRequest(), timeout=CALL_TIMEOUT_S)
                        unreachable_since = None
                        if run.lines < next_line:
                            show("controller: restarted; following the run it resumed")
                            next_line = 0


class RunClient:
    """`rlfleet run`: the platform, a run started on its controller, watched to its end."""

    def __init__(self, config: RunConfig, options: RunOptions | None = None) -> None:
        self.config = config
        self.options = options or RunOptions()
        self.run_dir = Path(config.run_dir or f"runs/{config.run_id}").resolve()
        self.stop = asyncio.Event()
        self.interrupted = ""  # why this client stopped the run, when it did
        self.status = ""  # the run's last status, as the controller said it

    async def run(self) -> dict:
        resuming = self.take_over_run_dir()
        base = await asyncio.to_thread(self.base_policy)
        platform, owned = await asyncio.to_thread(self.platform, base, resuming)
        if self.options.up_only:
            say(f"platform: up for run {self.config.run_id}; "
                f"`rlfleet run {self.config_arg()}` attaches to it, "
                f"`rlfleet down --run-dir {self.run_dir}` stops it")
            return {}
        controller = Controller(platform.state.by_name("controller").address)
        done = asyncio.Event()
        watching = asyncio.create_task(self.watch_processes(platform, controller, done))
        try:
            await controller.start(self.config, self.options, self.run_dir)
            stopping = asyncio.create_task(self._stop_when_asked(controller))
            try:
                final = await controller.follow(say, self.stop)
            finally:
                stopping.cancel()
            self.status, self.interrupted = final.status, self.interrupted or final.reason
        finally:
            done.set()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(watching, 30)
            await controller.close()
            if owned and not self.options.keep_up:
                await asyncio.to_thread(platform.down)
            else:
                say(f"platform: left running; stop it with `rlfleet down --run-dir {self.run_dir}`")
        summary = self.summary()
        if self.status != "finished":
            self.interrupted = self.interrupted or self.status
            say(f"interrupted ({self.interrupted}) after {summary.get('wall_s', 0.0):.0f} s of loop time; "
                f"continue with: rlfleet run {self.config_arg()} --resume")
        return summary

    def config_arg(self) -> str:
        return self.options.config_path or "CONFIG"

    def take_over_run_dir(self) -> bool:
        """Refuses what the controller would refuse, before any platform is started; says whether this
        continues an earlier run (the platform then starts on its durable state)."""
        check = RLRun(self.config, self.options, output=lambda _line: None)
        check.take_over_run_dir()
        return check.resuming

    def summary(self) -> dict:
        path = self.run_dir / "summary.json"
        return json.loads(path.read_text()) if path.exists() else {}

    async def _stop_when_asked(self, controller: Controller) -> None:
        await self.stop.wait()
        await controller.stop(self.interrupted or SIGNALLED)

    def base_policy(self) -> Path:
        cache = (Path(self.config.model_cache_dir).resolve() if self.config.model_cache_dir
                 else self.run_dir.parent / ".cache")
        return ensure_base_policy(cache, self.config.model, self.config.warm_start, self.config.system_prompt,
                                  say, suite=self.config.suite)

    def platform_config(self, base: Path) -> PlatformConfig:
        """The launch of this run: the engine pools (canary: rollouts; candidate: the gate's
        evaluations; fleet: the accepted version) serving the base policy, the run's service
        sections as resolved, the controller among them."""
        c = self.config
        sections = {name: section.model_copy(deep=True) for name, section in c.sections().items()}
        return PlatformConfig(run_id=c.run_id, run_dir=str(self.run_dir),
                              engines=c.engines.canary + c.candidate_engines + c.engines.fleet,
                              canary_engines=c.engines.canary, candidate_engines=c.candidate_engines,
                              model_path=str(base), log_format="json", restart=c.restart.model_copy(),
                              start_timeout_s=c.start_timeout_s, **sections)

    def platform(self, base: Path, resuming: bool) -> tuple[Platform, bool]:
        """The platform of this run directory: attached to when it is up, else started (returns it and
        whether this run owns it)."""
        wanted = self.platform_config(base)
        try:
            running = PlatformState.load(self.run_dir)
        except StartupError:
            running = None
        alive = [p for p in running.processes if is_ours(p)] if running else []
        if running is not None and alive:
            down = [p.name for p in running.processes if not is_ours(p)]
            if down:
                raise StartupError(f"the platform in {self.run_dir} is partly down ({', '.join(down)}); "
                                   f"`rlfleet down --run-dir {self.run_dir}` and run again "
                                   f"(add --resume to continue)")
            differs = platform_differences(running.config, wanted.model_dump(mode="json"))
            if differs:
                raise StartupError(f"the platform running in {self.run_dir} was not started for this "
                                   f"config ({'; '.join(differs)}); stop it with "
                                   f"`rlfleet down --run-dir {self.run_dir}`, or start it for this run with "
                                   f"`rlfleet run {self.config_arg()} --up-only`")
            say(f"platform: attached to the one running in {self.run_dir}")
            # call its services with the run's operator certificate
            use_run_secrets(self.run_dir, wanted.run_id)
            attached = Platform(wanted)
            attached.state = running
            return attached, False
        if not resuming:
            removed = clear_run_outputs(self.run_dir)
            if removed:
                say(f"platform: starting over in {self.run_dir} "
                    f"(removed the previous run's {', '.join(removed)})")
        say(f"platform: starting in {self.run_dir} ...")
        platform = Platform(wanted)
        platform.up()
        say("platform: healthy (" + ", ".join(p.name for p in platform.state.processes) + ")")
        return platform, True

    async def watch_processes(self, platform: Platform, controller: Controller, done: asyncio.Event) -> None:
        """Until the run ends: a platform process that dies is started again on its own ports (the
        launcher's restart policy) and the run goes on; with restarts turned off, a death stops the
        run as interrupted (the run directory can resume it)."""
        started = time.monotonic()
        await asyncio.to_thread(platform.start_standbys)
        while not done.is_set():
            gone = [p.name for p in platform.state.processes if not is_ours(p)]
            if gone and (not platform.config.restart.enabled or platform.stopping()):
                self.interrupted = f"{', '.join(gone)} stopped running" + (
                    " (`rlfleet down`)" if platform.stopping() else "")
                say(f"[{time.monotonic() - started:5.0f}s] {self.interrupted}; stopping the run (see "
                    f"{self.run_dir / 'logs'})")
                self.stop.set()
                return
            if gone or platform.restarting():
                for event in await asyncio.to_thread(platform.restart_dead, wait=False):
                    say(f"[{time.monotonic() - started:5.0f}s] {event}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 0.5)


FLAGS = ("--resume", "--fresh", "--keep-up", "--up-only")
USAGE = """rlfleet run CONFIG [--resume | --fresh] [--keep-up | --up-only] [config flags]

  --resume    continue the interrupted run in the run directory from its last checkpoint
  --fresh     discard an interrupted run in the run directory and start over
  --keep-up   leave the platform running when the run ends (the next run attaches to it)
  --up-only   bring the platform up for this config and return (a later run attaches to it)
"""


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(USAGE)
    options = RunOptions(resume="--resume" in argv, fresh="--fresh" in argv, keep_up="--keep-up" in argv,
                         up_only="--up-only" in argv)
    argv = [a for a in argv if a not in FLAGS]
    if options.resume and options.fresh:
        raise StartupError("--resume and --fresh contradict each other: choose one")
    if argv and not argv[0].startswith("-"):
        options.config_path = argv[0]
        argv = ["--config", argv[0], *argv[1:]]
    config = load_config(RunConfig, argv, prog="rlfleet run")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    run = RunClient(config, options)

    async def go() -> dict:
        loop = asyncio.get_running_loop()
        main_task = asyncio.current_task()
        assert main_task is not None  # go() runs as the event loop's main task

        def interrupt() -> None:
            if run.stop.is_set():  # a second Ctrl-C: stop waiting for the orderly end
                main_task.cancel()
                return
            run.interrupted = run.interrupted or SIGNALLED
            say("stopping (Ctrl-C again to stop at once) ...")
            run.stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, interrupt)
        return await run.run()

    try:
        uvloop.run(go())
    except asyncio.CancelledError:
        return 130
    if run.interrupted:
        return 130 if run.interrupted == SIGNALLED else 1
    return 0
