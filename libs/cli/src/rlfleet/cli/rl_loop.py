"""The asynchronous RL loop, as the controller drives it (rlfleet.controller; `rlfleet run` is its client).

    baseline     <- evaluate the base policy on the held-out split and the regression set
    loop until the budget (steps or time):
        feeder keeps TASKS topped up | workers run groups of G episodes | the trainer steps on complete
        groups and announces versions | the broker ships them to the canary engines | admission keeps
        rollouts within the staleness bound | the gate evaluates candidates and promotes the good ones
    final        <- evaluate the accepted version; report (summary.json, plots, report.html)

`mode = "sync"` runs the same system in lock-step: one step's tasks, wait for the new version to be
served, repeat.

The loop runs on a platform someone else launched and supervises (the launcher's restart policy,
compose's, Kubernetes'): every background part of the loop is supervised (a failure is said and the
part started again), every call to a service has a deadline, and a stop abandons a gate evaluation
at once.

The platform (and the run's state, which the driver saves through its `StateSink`) holds
everything needed to go on after an interruption (a stop, the controller killed, a death with
`restart.enabled = false`): a resume continues from the trainer's last checkpoint, with the tasks,
trajectories and budget where they were (see run_state.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import grpc

from rlfleet.api.broker.v1 import broker_pb2, broker_pb2_grpc
from rlfleet.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from rlfleet.api.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from rlfleet.api.verifier.v1 import verifier_pb2_grpc
from rlfleet.cli.launcher import PlatformState, flatten_keys, start_ticks
from rlfleet.cli.loop_parts import (
    Clock,
    CpuSampler,
    Feeder,
    Observer,
    SlowTools,
    evaluate,
    latency_sampler,
    task_messages,
)
from rlfleet.cli.loop_watch import LoopWatch
from rlfleet.cli.platform_config import SECTIONS
from rlfleet.cli.promotion import PromotionGate
from rlfleet.cli.report import EpisodeRecord, EvalResult, RunRecord, StepRecord, summary_lines, write_report
from rlfleet.cli.run_config import RunConfig
from rlfleet.cli.run_context import LoopContext, Stopped, rpc, say, stopped, wait_served
from rlfleet.cli.run_state import (
    RESUMABLE_CHANGES,
    STATE_FILE,
    RecordJSON,
    RunDirFile,
    RunState,
    StateSink,
    config_changes,
    driver_alive,
    eval_from_dict,
    host_identity,
    record_from_dict,
)
from rlfleet.cli.stop_checks import StopChecks
from rlfleet.common.config import NatsConfig
from rlfleet.common.errors import StartupError
from rlfleet.common.grpc_server import channel
from rlfleet.common.infra_auth import run_dir_login
from rlfleet.common.streams import connect_nats
from rlfleet.envkit.sdk.clients import Clients
from rlfleet.envkit.sdk.environment import environments
from rlfleet.envkit.submit import write_for_verifier
from rlfleet.envkit.suites import generate_tasks
from rlfleet.envkit.worker import RolloutWorker
from rlfleet.envkit.worker_config import WorkerConfig

log = logging.getLogger(__name__)

__all__ = ["Peers", "PlatformView", "RLRun", "RunOptions", "Stopped", "platform_differences", "say"]


@dataclass
class RunOptions:
    """How this invocation treats the run directory (flags, not configuration)."""

    resume: bool = False    # continue the interrupted run in the run directory
    fresh: bool = False     # discard an interrupted run there and start over
    keep_up: bool = False   # leave the platform running at the end (`rlfleet run`)
    up_only: bool = False   # bring the platform up for this run and return (`rlfleet run`)
    config_path: str = ""   # for the hints printed
    # drive the run on a platform someone else launched and supervises (the controller)
    attach_only: bool = False


@dataclass(frozen=True)
class PlatformView:
    """Where the loop finds the platform: the services' addresses, the NATS logins of the driver
    (operator rights: it hands out tasks and follows trajectories and versions) and of its rollout
    worker, the trainer's metrics page, and the processes whose CPU the report shows. The controller
    has them from its config (local launches, compose and Kubernetes alike); `of_launch` reads them
    from a local launch's record."""

    nats: NatsConfig
    worker_nats: NatsConfig
    gateway: str
    trainer: str
    broker: str
    verifier: str
    session: str
    sandbox: str
    trainer_metrics_url: str = ""
    pids: tuple[int, ...] = ()

    @classmethod
    def of_launch(cls, state: PlatformState) -> PlatformView:
        url = state.by_name("nats").url
        trainer = state.by_name("trainer")
        return cls(nats=NatsConfig(url=url, **run_dir_login(state.run_dir, "nats", "operator")),
                   worker_nats=NatsConfig(url=url, **run_dir_login(state.run_dir, "nats", "worker")),
                   gateway=state.by_name("rollout-gateway").address, trainer=trainer.address,
                   broker=state.by_name("weight-broker").address, verifier=state.by_name("verifier").address,
                   session=state.by_name("session-server").address,
                   sandbox=state.by_name("sandbox-manager").address,
                   trainer_metrics_url=(f"http://127.0.0.1:{trainer.metrics_port}/metrics"
                                        if trainer.metrics_port else ""),
                   pids=tuple(p.pid for p in state.processes))


@dataclass
class Peers:
    """What the driver talks to: the platform's places, NATS (JetStream), the SDK's clients of the
    session server, sandbox manager and verifier, and stubs of the gateway, trainer and broker."""

    platform: PlatformView
    nc: Any
    js: Any
    clients: Clients
    gateway: gateway_pb2_grpc.GatewayServiceStub
    trainer: trainer_pb2_grpc.TrainerServiceStub
    broker: broker_pb2_grpc.BrokerServiceStub
    verifier: verifier_pb2_grpc.VerifierServiceStub  # its Audit (the SDK's client scores episodes only)


class RLRun:
    """One run of the loop: its state (saved through its `StateSink`, resumed from it), the loop
    itself, and the named parts it starts (rollout worker, feeder, promotion gate, stop checks,
    watch, CPU sampler, state saver), each supervised."""

    def __init__(self, config: RunConfig, options: RunOptions | None = None,
                 output: Callable[[str], None] | None = None, platform: PlatformView | None = None,
                 sink: StateSink | None = None) -> None:
        self.config = config
        self.platform = platform  # where the platform is; None: the launch record in the run directory
        self.options = options or RunOptions()
        self.run_dir = Path(config.run_dir or f"runs/{config.run_id}").resolve()
        self.sink = sink or RunDirFile(self.run_dir)  # where its state is saved (the controller: its store)
        record = RunRecord(config.run_id, config.mode, config.model_dump(mode="json"), time.time())
        self.ctx = LoopContext(config, self.run_dir, record, say=output or say)
        self.state = RunState("running", config.model_dump(mode="json"), uuid.uuid4().hex[:12],
                              driven_by="controller" if self.options.attach_only else "rlfleet run",
                              eval_seed=(config.eval.seed if config.eval.seed is not None
                                         else secrets.randbelow(2**31)))
        self.record_json = RecordJSON()  # the saved state's record, its trajectories each encoded once
        self.feeder: Feeder | None = None
        self._drained_since: float | None = None  # when TASKS was last seen empty (sync mode)
        self.resuming = False
        self.loop_started = False  # before it, no loop time is spent (warm start, platform, baseline)
        self.driver = (os.getpid(), start_ticks(os.getpid()) or 0)  # recorded so a second driver is refused

    # What the run's callers (the controller, `rlfleet run`, tests) read and set: the shared state's.
    @property
    def record(self) -> RunRecord:
        return self.ctx.record

    @property
    def stop(self) -> asyncio.Event:
        return self.ctx.stop

    @property
    def clock(self) -> Clock:
        return self.ctx.clock

    @property
    def say(self) -> Callable[[str], None]:
        return self.ctx.say

    @property
    def interrupted(self) -> str:
        return self.ctx.interrupted

    @interrupted.setter
    def interrupted(self, why: str) -> None:
        self.ctx.interrupted = why

    @property
    def accepted_eval(self) -> EvalResult | None:
        return self.ctx.accepted_eval

    @property
    def last_gated(self) -> int:
        return self.ctx.last_gated

    # -- the whole run ------------------------------------------------------------------------

    async def run(self) -> dict:
        """The run on a platform that someone else launched and supervises (restarts are not this
        run's business): the controller drives runs this way."""
        platform = self.platform or PlatformView.of_launch(PlatformState.load(self.run_dir))
        try:
            async with self._connections(platform) as peers:
                await self._loop(peers)
        except BaseException as exc:
            self.interrupted = self.interrupted or f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self.record.wall_s = self.record.wall_s or (self.clock.elapsed() if self.loop_started else 0.0)
            self.record.status = "interrupted" if self.interrupted else "finished"
            await self.save_state()
        summary = write_report(self.record, self.run_dir)
        for line in summary_lines(summary):
            self.say(line)
        self.say(f"report: {self.run_dir / 'report.html'}  summary: {self.run_dir / 'summary.json'}")
        return summary

    def take_over_run_dir(self) -> None:
        """Decides from the run directory's run_state.json whether this is a new run or the
        continuation of one (`rlfleet run`, before its platform is up)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.take_over(RunState.load(self.run_dir), f"{self.run_dir} (no {STATE_FILE})")

    def take_over(self, previous: RunState | None, where: str) -> None:
        """Decides from the run's last saved state (None: there is none in `where`) whether this is
        a new run or the continuation of one."""
        if previous is not None and previous.status == "running" \
                and driver_alive(previous.driver_pid, previous.driver_start, previous.driver_host):
            driver = "`rlfleet run`" if previous.driven_by == "rlfleet run" else previous.driven_by
            raise StartupError(f"another {driver} (pid {previous.driver_pid}) is driving "
                               f"{self.run_dir}; stop it first")
        if self.options.resume:
            if previous is None:
                raise StartupError(f"nothing to resume in {where}; run without --resume to start a run")
            changes = config_changes(previous.config, self.config.model_dump(mode="json"))
            if changes:
                raise StartupError("the config differs from the run being resumed in what it trains "
                                   f"(only {', '.join(RESUMABLE_CHANGES)} may change): {'; '.join(changes)}")
            self._restore(previous)
            return
        if previous is not None and previous.status != "finished" and not self.options.fresh:
            raise StartupError(f"{self.run_dir} holds an interrupted run "
                               f"({previous.reason or previous.status}, "
                               f"{previous.loop_s:.0f} s of loop time); `--resume` continues it, "
                               f"`--fresh` discards it and starts over")

    def _restore(self, previous: RunState) -> None:
        ctx = self.ctx
        self.resuming = True
        self.state = previous
        self.state.resumes.append(previous.loop_s)
        previous.eval_seed = previous.evaluation_seed()  # paired with its evaluations so far
        ctx.record = record = record_from_dict(previous.record)
        previous.record = {}  # from now on the state saves the live record (`record_json`)
        record.notes.append(f"resumed at {previous.loop_s:.0f} s of loop time"
                            + (f" after: {previous.reason}" if previous.reason else ""))
        record.config = self.config.model_dump(mode="json")  # the budget may have grown
        record.wall_s = 0.0
        record.status = "running"  # again (a finished run resumed with a larger budget)
        ctx.accepted_eval = eval_from_dict(previous.accepted_eval)
        ctx.accepted_regression = eval_from_dict(previous.accepted_regression)
        record.accepted_version = previous.accepted_version
        ctx.last_gated = previous.last_gated
        self.say(f"resume: {self.run_dir} at {previous.loop_s:.0f} s of loop time, accepted version "
                 f"{previous.accepted_version}, {previous.tasks_published} tasks handed out")

    async def save_state(self) -> None:
        await self.sink.save(self.current_state())

    def current_state(self) -> RunState:
        """The run's state as of now (what `save_state` saves)."""
        s, ctx = self.state, self.ctx
        s.status = "interrupted" if ctx.interrupted else (
            "finished" if ctx.record.status == "finished" else "running")
        s.reason = ctx.interrupted
        if self.loop_started:
            s.loop_s = ctx.clock.elapsed()
        s.last_gated = ctx.last_gated
        s.accepted_version = ctx.record.accepted_version
        s.accepted_eval = asdict(ctx.accepted_eval) if ctx.accepted_eval else None
        s.accepted_regression = asdict(ctx.accepted_regression) if ctx.accepted_regression else None
        if self.feeder is not None:
            s.tasks_published = self.feeder.published
        s.record_json = self.record_json.encode(ctx.record)
        s.driver_pid, s.driver_start = self.driver
        s.driver_host = host_identity()
        return s

    # -- connections ----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _connections(self, platform: PlatformView):
        """NATS, the SDK's clients and stubs of the gateway, trainer and broker, closed on the way out."""

        channels = [channel(address) for address in (platform.gateway, platform.trainer, platform.broker,
                                                     platform.verifier)]
        nc = await connect_nats(platform.nats, "rlfleet-run")
        clients = Clients.connect(session=platform.session, sandbox=platform.sandbox,
                                  verifier=platform.verifier)
        peers = Peers(platform=platform, nc=nc, js=nc.jetstream(), clients=clients,
                      gateway=gateway_pb2_grpc.GatewayServiceStub(channels[0]),
                      trainer=trainer_pb2_grpc.TrainerServiceStub(channels[1]),
                      broker=broker_pb2_grpc.BrokerServiceStub(channels[2]),
                      verifier=verifier_pb2_grpc.VerifierServiceStub(channels[3]))
        try:
            yield peers
        finally:
            await clients.close()
            for ch in channels:
                await ch.close()
            await nc.close()

    # -- the loop -------------------------------------------------------------------------------

    async def _loop(self, peers: Peers) -> None:
        c, ctx = self.config, self.ctx
        train, heldout, regression = self._tasks()
        checks = StopChecks(ctx, peers.verifier, kinds={t.verifier.kind for t in train})
        gate = PromotionGate(ctx, peers.broker, partial(self._evaluate, peers), checks, self.save_state,
                             heldout, regression)
        watch = LoopWatch(ctx, peers.broker, peers.trainer, peers.platform.trainer_metrics_url)
        if not await self._audited_before_the_loop(checks):
            return
        if ctx.accepted_eval is None:  # a new run, or one interrupted before its baseline was done
            try:
                await self._baseline(peers, heldout, regression)
            except Stopped:
                self.say("baseline: abandoned (stopping)")
                return
            self.record.started_unix = time.time()
        # Loop time (the budget, every figure's time axis) starts after the baseline evaluation.
        ctx.clock = Clock(self.state.loop_s)
        self.loop_started = True
        observer = Observer(peers.js, c.run_id, self.record, ctx.clock)
        observer.version_listeners.append(self._note_step)
        await observer.start()
        await self._admit_up_to(peers, observer.latest_version)
        worker = self._worker(peers)
        self.feeder = feeder = Feeder(peers.js, c.run_id,
                                      task_messages(train, c.run_id, c.group_size, c.rollout.temperature,
                                                    c.system_prompt),
                                      attempt=self.state.attempt, published=self.state.tasks_published)
        # Sync mode's count of groups seen on TRAJECTORIES starts level with what was handed out: a group
        # half published before an interruption is never complete to this observer. (What is in flight
        # is counted off TASKS itself, `Feeder.in_flight`.)
        observer.groups_done = feeder.published
        done = observer.latest_version - self.state.start_version
        self.say(f"loop: {c.mode}, G={c.group_size}, {c.trainer.groups_per_step} groups/step, "
                 f"budget {c.budget.max_steps} steps or {c.budget.max_minutes:g} min"
                 + (f" ({done} steps and {ctx.clock.elapsed():.0f} s done)" if self.resuming else ""))
        await watch.trainer_idle()  # marks where the trainer's account starts
        sampler = CpuSampler(list(peers.platform.pids), self.record, ctx.clock)
        parts = {"the rollout worker": lambda: worker.run(ctx.stop),
                 "the CPU sampler": lambda: sampler.run(ctx.stop),
                 "the pause watch": watch.pauses,
                 "the state saver": self._keep_state_saved,
                 "the progress line": lambda: watch.progress(observer),
                 "the admission policy": lambda: self._follow_versions(peers, observer)}
        if c.mode == "async":
            in_flight = c.rollout.concurrency // c.group_size + c.rollout.backlog_groups
            ahead_steps = c.rollout.max_ahead_steps
            room_ahead = None if ahead_steps is None else partial(self._room_ahead, peers, ahead_steps)
            parts["the feeder"] = lambda: feeder.keep_topped_up(in_flight, ctx.stop, room_ahead)
            parts["the promotion gate"] = gate.follow_the_canary
        background = {name: asyncio.create_task(self._supervised(name, part)) for name, part in parts.items()}
        try:
            if c.mode == "async":
                await self._until_budget(observer)
            else:
                await self._sync_steps(peers, observer, gate)
        finally:
            self.record.wall_s = ctx.clock.elapsed()
            ctx.stop.set()
            for name, task in background.items():
                # The worker lets running groups finish (its drain_timeout_s, 30 s) before it returns.
                await stopped(task, name, say=self.say,
                              timeout_s=60.0 if task is background["the rollout worker"] else 15.0)
            await observer.stop()
        await watch.trainer_idle()
        if self.interrupted:
            await self._checkpoint(peers)
        else:
            await self._finish(peers, checks, heldout, regression)

    async def _audited_before_the_loop(self, checks: StopChecks) -> bool:
        # A resumed run (a restarted controller) passed its audit before the loop first started, on a
        # verifier whose config a resume cannot change, and is audited again before every promotion:
        # auditing again here held the restarted loop's rollouts up for the audit's 40 episodes
        # (24 s at load ~9), and an audit beside the loop scored episodes failed by a sandbox
        # manager killed meanwhile as the verifier's errors and stopped the run.
        if self.resuming and any(a.get("when") == "before the loop" and not a.get("breaches")
                                 for a in self.record.audits):
            self.say("verifier audit: passed before the loop; the next is before the next promotion")
            return True
        return await checks.verifier_trusted("before the loop")

    async def _baseline(self, peers: Peers, heldout, regression) -> None:
        """The version the fleet serves before RL: 0 on a new platform, the accepted one on a platform
        attached to after earlier runs."""
        ctx = self.ctx
        status = await rpc(peers.broker.GetStatus, broker_pb2.GetStatusRequest())
        fleet = [e.policy_version for e in status.engines if e.pool == "fleet"]
        version = min(fleet) if fleet else 0
        trainer = await rpc(peers.trainer.GetStatus, trainer_pb2.GetStatusRequest(), timeout_s=30)
        self.state.start_version = max(0, trainer.policy_version)
        self.record.accepted_version = ctx.last_gated = version
        seeded = (f", evaluation seed {self.state.eval_seed}" if self.config.eval.seeded
                  else ", unseeded")
        self.say(f"baseline: evaluating version {version} on {len(heldout)} held-out and {len(regression)} "
                 f"regression tasks{seeded} ...")
        if self.config.eval.seeded:
            self.record.notes.append(f"evaluation seed {self.state.eval_seed} (eval.seed repeats its draws)")
        # A stop during the baseline abandons it (Stopped): a resumed run evaluates it again.
        baseline = await ctx.unless_stopped(
            self._evaluate(peers, heldout, version, "heldout", "baseline", "fleet"))
        ctx.accepted_regression = await ctx.unless_stopped(
            self._evaluate(peers, regression, version, "regression", "baseline", "fleet")) \
            if regression else None
        ctx.accepted_eval = baseline
        self.say(f"baseline: held-out success {baseline.success:.3f}")
        for result in (ctx.accepted_eval, ctx.accepted_regression):
            if result is not None:
                result.elapsed_s = 0.0  # the start of loop time

    def _note_step(self, version) -> None:
        # POLICY is replayed from its start on every (re)start: only versions not yet recorded are new.
        newest = self.record.steps[-1].version if self.record.steps else self.state.start_version
        # The trainer is stopped only after the budget's last version is seen, so in async mode it can
        # publish one more step from groups it already held: that step is past the budget, and a run
        # that counted (and evaluated) it would not be comparable at equal steps.
        last = self.state.start_version + self.config.budget.max_steps
        if newest < version.version <= last:
            self.record.steps.append(StepRecord(step=int(version.step), version=int(version.version),
                                                elapsed_s=self.clock.elapsed(),
                                                reward_mean=float(version.metrics.get("reward_mean", 0.0)),
                                                metrics=dict(version.metrics)))

    def _tasks(self):
        c = self.config
        train = generate_tasks(c.suite, "train", 2000, seed=c.seed, difficulty=c.difficulty)
        heldout = generate_tasks(c.suite, "heldout", c.eval.heldout, seed=c.seed, difficulty=c.difficulty)
        regression = generate_tasks(c.suite, "regression", c.eval.regression, seed=c.seed,
                                    difficulty=c.difficulty) if c.eval.regression else []
        write_for_verifier(train + heldout + regression, self.run_dir / "suites")
        as_messages = lambda tasks: task_messages(tasks, c.run_id, 1, c.eval.temperature, c.system_prompt)  # noqa: E731
        return train, as_messages(heldout), as_messages(regression)

    def _worker(self, peers: Peers) -> RolloutWorker:
        c, platform = self.config, peers.platform
        delay = latency_sampler(c.rollout.tool_latency, c.seed)
        # Evaluations score with the plain environments: the slow-tool latency models the training
        # fleet's tools, not the scoring.
        plain = environments(c.rollout.tool_runtime)
        training = plain
        if c.rollout.tool_latency.distribution != "none":
            training = lambda suite: SlowTools(plain(suite), delay)  # noqa: E731
        config = WorkerConfig(run_id=c.run_id,
                              nats=platform.worker_nats.model_dump(),
                              session_address=platform.session, sandbox_address=platform.sandbox,
                              verifier_address=platform.verifier,
                              concurrency=c.rollout.concurrency, tool_runtime=c.rollout.tool_runtime,
                              tool_call_format=c.rollout.tool_call_format,
                              observation_framing=c.rollout.observation_framing, metrics={"enabled": False})
        return RolloutWorker(config, environments=training, clients=peers.clients,
                             on_episode=self._note_episode)

    def _note_episode(self, summary) -> None:
        """A training episode's phases, tools and verdict, for the report (the worker's own account)."""
        if summary.end in ("error", "cancelled"):
            return  # not the policy's: the platform failed or the run stopped
        self.record.episodes.append(EpisodeRecord(
            elapsed_s=self.clock.elapsed(), passed=summary.passed, reasons=list(summary.reasons),
            tools=dict(summary.tools), invalid_calls=summary.invalid_calls, generate_s=summary.generate_s,
            tool_s=summary.tool_wait_s, sandbox_s=summary.sandbox_s, verify_s=summary.verify_s,
            episode_s=summary.episode_s))

    async def _evaluate(self, peers: Peers, tasks, version: int, split: str, label: str, pool: str,
                        keep: bool = True) -> EvalResult:
        c = self.config
        result = await evaluate(peers.clients, tasks, version=version, split=split, label=label, pool=pool,
                                concurrency=c.eval.concurrency, clock=self.clock,
                                environments=environments(c.rollout.tool_runtime),
                                seed=self.state.eval_seed if c.eval.seeded else None,
                                tag=f"{label}-v{version}-{split}-{time.monotonic_ns()}")
        if keep:
            self.record.evals.append(result)
        return result

    # -- pacing: admission, the budget, lock-step ---------------------------------------------------

    async def _admit_up_to(self, peers: Peers, trainer_version: int) -> None:
        await rpc(peers.gateway.SetAdmissionPolicy, gateway_pb2.AdmissionPolicy(
            max_inflight_sessions=self.config.rollout.max_inflight_sessions, trainer_version=trainer_version,
            max_staleness=self.config.rollout.max_staleness))

    async def _room_ahead(self, peers: Peers, ahead_steps: float, groups_in_tasks: int) -> int:
        """How many more groups `rollout.max_ahead_steps` lets the feeder hand out: the samples the
        trainer could train now (its stream backlog but the samples of groups still incomplete, which
        are counted with their group in TASKS) and those of the groups in TASKS count as ahead of it."""
        c = self.config
        try:
            status = await rpc(peers.trainer.GetStatus, trainer_pb2.GetStatusRequest(), within_s=10.0)
        except grpc.aio.AioRpcError as exc:  # the trainer away: nothing more until it answers again
            log.info("handing out tasks waits for the trainer (%s)", exc.code().name)
            return 0
        ahead = max(0, status.queue_depth - status.pending_samples) + groups_in_tasks * c.group_size
        limit = ahead_steps * c.trainer.groups_per_step * c.group_size
        return int((limit - ahead) // c.group_size)

    async def _follow_versions(self, peers: Peers, observer: Observer) -> None:
        """Moves the gateway's admission (staleness bound) along with each new trainer version."""
        admitted = observer.latest_version
        while not self.stop.is_set():
            if observer.latest_version > admitted:
                version = observer.latest_version
                await self._admit_up_to(peers, version)
                admitted = version
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), 0.2)

    def _budget_spent(self, observer: Observer) -> bool:
        budget = self.config.budget
        return (observer.latest_version - self.state.start_version >= budget.max_steps
                or self.clock.elapsed() >= budget.max_minutes * 60)

    async def _until_budget(self, observer: Observer) -> None:
        while not self.stop.is_set() and not self._budget_spent(observer):  # noqa: ASYNC110 - a clock, not an event
            await asyncio.sleep(0.5)

    async def _sync_steps(self, peers: Peers | None, observer: Observer, gate: PromotionGate | None) -> None:
        """Lock-step: hand out one step's groups, wait for the step and for its version to be served.

        Groups GRPO cannot learn from (all rewards equal) are dropped by the trainer, so when every
        group handed out is done and the step has not happened, the missing groups are handed out."""
        c = self.config
        assert self.feeder is not None  # the loop made it before the steps
        while not self.stop.is_set() and not self._budget_spent(observer):
            target = observer.latest_version + 1
            needed, trainable_before, quiet_since = (c.trainer.groups_per_step,
                                                     observer.trainable_groups_done, None)
            while not self.stop.is_set() and observer.latest_version < target:
                if await self._handed_out_done(observer):
                    got = observer.trainable_groups_done - trainable_before
                    if got < needed:
                        await self.feeder.publish(needed - got)
                        quiet_since = None
                    elif quiet_since is None:
                        quiet_since = time.monotonic()
                    elif time.monotonic() - quiet_since > 30:
                        # The trainer saw fewer learnable groups than counted here (say, samples it
                        # rejected): hand out one more rather than wait forever.
                        needed += 1
                        quiet_since = None
                await asyncio.sleep(0.05)
            await self._wait_served(peers, target, pool="canary")
            if gate is not None and gate.due(target):
                began = self.clock.elapsed()
                await gate.decide(target)
                self.record.gate_wait_s += self.clock.elapsed() - began

    async def _handed_out_done(self, observer: Observer) -> bool:
        """Every task handed out is finished (none left in TASKS) and the observer has seen its
        trajectories, or a second has passed for it to: a group with a sample closed FAILED is never
        complete on TRAJECTORIES, and must not hold the step forever."""
        assert self.feeder is not None
        if await self.feeder.in_flight():
            self._drained_since = None
            return False
        if self.feeder.published - observer.groups_done <= 0:
            return True
        self._drained_since = self._drained_since or time.monotonic()
        return time.monotonic() - self._drained_since > 1.0

    async def _wait_served(self, peers: Peers | None, version: int, pool: str,
                           until_stopped: bool = True) -> bool:
        assert peers is not None
        return await wait_served(peers.broker, version, pool, timeout_s=120.0,
                                 stop=self.stop if until_stopped else None)

    # -- the end ----------------------------------------------------------------------------------

    async def _finish(self, peers: Peers, checks: StopChecks, heldout, regression) -> None:
        checks.account_long_tail()
        if not self.config.gate.enabled and self.record.steps:
            self.record.accepted_version = max(s.version for s in self.record.steps)  # auto-promoted
        accepted = self.record.accepted_version
        if not await self._wait_served(peers, accepted, pool="fleet", until_stopped=False):
            self.record.notes.append(f"the fleet did not serve version {accepted} in time for the final "
                                     f"evaluation")
        self.say(f"final: evaluating the accepted version {accepted} on the held-out split ...")
        await self._evaluate(peers, heldout, accepted, "heldout", "final", "fleet")
        if regression:
            await self._evaluate(peers, regression, accepted, "regression", "final", "fleet")

    async def _checkpoint(self, peers: Peers) -> None:
        """After an interruption: make every step taken durable, so a resume retrains nothing."""

        try:
            done = await peers.trainer.Checkpoint(trainer_pb2.CheckpointRequest(), timeout=60)
            self.say(f"checkpoint: step {done.step}, version {done.policy_version}")
        except grpc.aio.AioRpcError as exc:
            # A trainer that is gone keeps its last checkpoint; the steps after it are redone from
            # the trajectories JetStream still holds for it, exactly once.
            self.record.notes.append(f"no checkpoint at the interruption ({exc.code().name}): the trainer "
                                     "resumes from its last one")

    # -- keeping the parts alive ------------------------------------------------------------------

    async def _supervised(self, name: str, part: Callable[[], Awaitable[Any]]) -> None:
        """Runs one background part of the loop until the stop. A part that fails is said loudly
        (on screen, in the log and in the report's notes) and started again with bounded backoff:
        it is never left dead in silence."""
        delay = 0.5
        while not self.stop.is_set():
            try:
                await part()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                line = f"{name} failed ({type(exc).__name__}: {exc}); starting it again in {delay:.1f} s"
                self.say(f"[{self.clock.elapsed():5.0f}s] {line}")
                log.error("%s failed", name, exc_info=exc)
                self.record.notes.append(line)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), delay)
            delay = min(delay * 2, 10.0)

    async def _keep_state_saved(self, every_s: float = 10.0) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stop.wait(), every_s)
            if not self.stop.is_set():
                await self.save_state()


def platform_differences(running: dict, wanted: dict) -> list[str]:
    """What in the running platform's launch config would make it a different platform for this run."""
    keys = ("run_id", "engines", "canary_engines", "candidate_engines", "model_path", *SECTIONS.values())
    have = dict(flatten_keys({k: running.get(k) for k in keys}))
    need = dict(flatten_keys({k: wanted.get(k) for k in keys}))
    return [f"{key}: running {have.get(key)!r}, this run needs {need.get(key)!r}"
            for key in sorted(set(have) | set(need)) if have.get(key) != need.get(key)]


