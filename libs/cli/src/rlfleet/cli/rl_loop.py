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
import json
import logging
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc

from rlfleet.api.broker.v1 import broker_pb2, broker_pb2_grpc
from rlfleet.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from rlfleet.api.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from rlfleet.api.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from rlfleet.cli.gate import Decision, decide, interim, merge, slices
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
from rlfleet.cli.platform_config import SECTIONS
from rlfleet.cli.report import EpisodeRecord, EvalResult, GateDecision, RunRecord, StepRecord, write_report
from rlfleet.cli.run_config import RunConfig
from rlfleet.cli.run_state import (
    RESUMABLE_CHANGES,
    STATE_FILE,
    RunDirFile,
    RunState,
    StateSink,
    config_changes,
    driver_alive,
    eval_from_dict,
    host_identity,
    record_from_dict,
)
from rlfleet.cli.stop_rules import audit_result, audit_subset, long_tail
from rlfleet.common.config import NatsConfig
from rlfleet.common.errors import StartupError
from rlfleet.common.grpc_server import channel
from rlfleet.common.infra_auth import run_dir_login
from rlfleet.common.streams import connect_nats
from rlfleet.envkit.sdk.clients import Clients
from rlfleet.envkit.sdk.environment import environments
from rlfleet.envkit.submit import SubmitError, load_tasks, write_for_verifier
from rlfleet.envkit.suites import generate_tasks
from rlfleet.envkit.worker import RolloutWorker
from rlfleet.envkit.worker_config import WorkerConfig

log = logging.getLogger(__name__)


class Stopped(Exception):
    """The run's stop was set while waiting for something that no longer matters."""


def say(text: str) -> None:
    print(text, flush=True)


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
    def __init__(self, config: RunConfig, options: RunOptions | None = None,
                 output: Callable[[str], None] | None = None, platform: PlatformView | None = None,
                 sink: StateSink | None = None) -> None:
        self.config = config
        self.platform = platform  # where the platform is; None: the launch record in the run directory
        self.say = output or say  # where the run's progress lines go (the controller streams them)
        self.options = options or RunOptions()
        self.run_dir = Path(config.run_dir or f"runs/{config.run_id}").resolve()
        self.sink = sink or RunDirFile(self.run_dir)  # where its state is saved (the controller: its store)
        self.clock = Clock()
        self.record = RunRecord(config.run_id, config.mode, config.model_dump(mode="json"), time.time())
        self.state = RunState("running", config.model_dump(mode="json"), uuid.uuid4().hex[:12],
                              driven_by="controller" if self.options.attach_only else "rlfleet run")
        self.stop = asyncio.Event()
        self.interrupted = ""  # why the loop stopped before its budget, when it did
        self.accepted_eval: EvalResult | None = None
        self.accepted_regression: EvalResult | None = None
        self.audit_labels: list[dict] = []  # the labelled episodes each verifier audit sends
        # the trainer's dropped trajectories by reason (its /metrics)
        self.trainer_dropped: dict[str, float] = {}
        self.last_gated = 0
        self.feeder: Feeder | None = None
        self.resuming = False
        self._trainer_mark: tuple[float, float] | None = None  # (data-wait counter, loop time) last read
        self.loop_started = False  # before it, no loop time is spent (warm start, platform, baseline)
        self.driver = (os.getpid(), start_ticks(os.getpid()) or 0)  # recorded so a second driver is refused

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
        self._print_summary(summary)
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
        self.resuming = True
        self.state = previous
        self.state.resumes.append(previous.loop_s)
        self.record = record_from_dict(previous.record)
        self.record.notes.append(f"resumed at {previous.loop_s:.0f} s of loop time"
                                 + (f" after: {previous.reason}" if previous.reason else ""))
        self.record.config = self.config.model_dump(mode="json")  # the budget may have grown
        self.record.wall_s = 0.0
        self.record.status = "running"  # again (a finished run resumed with a larger budget)
        self.accepted_eval = eval_from_dict(previous.accepted_eval)
        self.accepted_regression = eval_from_dict(previous.accepted_regression)
        self.record.accepted_version = previous.accepted_version
        self.last_gated = previous.last_gated
        self.say(f"resume: {self.run_dir} at {previous.loop_s:.0f} s of loop time, accepted version "
            f"{previous.accepted_version}, {previous.tasks_published} tasks handed out")

    async def save_state(self) -> None:
        await self.sink.save(self.current_state())

    def current_state(self) -> RunState:
        """The run's state as of now (what `save_state` saves)."""
        s = self.state
        s.status = "interrupted" if self.interrupted else (
            "finished" if self.record.status == "finished" else "running")
        s.reason = self.interrupted
        if self.loop_started:
            s.loop_s = self.clock.elapsed()
        s.last_gated = self.last_gated
        s.accepted_version = self.record.accepted_version
        s.accepted_eval = asdict(self.accepted_eval) if self.accepted_eval else None
        s.accepted_regression = asdict(self.accepted_regression) if self.accepted_regression else None
        if self.feeder is not None:
            s.tasks_published = self.feeder.published
        s.record = asdict(self.record)
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

    async def _loop(self, peers) -> None:
        c = self.config
        train, heldout, regression = self._tasks(peers)
        # A resumed run (a restarted controller) passed its audit before the loop first started, on a
        # verifier whose config a resume cannot change, and is audited again before every promotion:
        # auditing again here held the restarted loop's rollouts up for the audit's 40 episodes
        # (24 s at load ~9), and an audit beside the loop scored episodes failed by a sandbox
        # manager killed meanwhile as the verifier's errors and stopped the run.
        audited = self.resuming and any(a.get("when") == "before the loop" and not a.get("breaches")
                                        for a in self.record.audits)
        if audited:
            self.say("verifier audit: passed before the loop; the next is before the next promotion")
        elif not await self._verifier_trusted(peers, "before the loop"):
            return
        if self.accepted_eval is None:  # a new run, or one interrupted before its baseline was done
            try:
                await self._baseline(peers, heldout, regression)
            except Stopped:
                self.say("baseline: abandoned (stopping)")
                return
            self.record.started_unix = time.time()
        # Loop time (the budget, every figure's time axis) starts after the baseline evaluation.
        self.clock = Clock(self.state.loop_s)
        self.loop_started = True
        observer = Observer(peers.js, c.run_id, self.record, self.clock)
        observer.version_listeners.append(self._note_step)
        await observer.start()
        await self._admit_up_to(peers, observer.latest_version)
        worker = self._worker(peers)
        self.feeder = feeder = Feeder(peers.js, c.run_id,
                                      task_messages(train, c.run_id, c.group_size, c.rollout.temperature,
                                                    c.system_prompt),
                                      attempt=self.state.attempt, published=self.state.tasks_published)
        # Groups handed out before an interruption come back after their ack wait, or are already done:
        # either way they are not counted as in flight, so the loop does not idle waiting for them.
        observer.groups_done = feeder.published
        done = observer.latest_version - self.state.start_version
        self.say(f"loop: {c.mode}, G={c.group_size}, {c.trainer.groups_per_step} groups/step, "
            f"budget {c.budget.max_steps} steps or {c.budget.max_minutes:g} min"
            + (f" ({done} steps and {self.clock.elapsed():.0f} s done)" if self.resuming else ""))
        self._trainer_mark = None
        await self._measure_trainer_idle(peers)
        sampler = CpuSampler(list(peers.platform.pids), self.record, self.clock)
        parts = {"the rollout worker": lambda: worker.run(self.stop),
                 "the CPU sampler": lambda: sampler.run(self.stop),
                 "the pause watch": lambda: self._watch_pauses(peers),
                 "the state saver": self._keep_state_saved,
                 "the progress line": lambda: self._progress(peers, observer),
                 "the admission policy": lambda: self._follow_versions(peers, observer)}
        if c.mode == "async":
            in_flight = c.rollout.concurrency // c.group_size + c.rollout.backlog_groups
            parts["the feeder"] = lambda: feeder.keep_topped_up(lambda: observer.groups_done, in_flight,
                                                                self.stop)
            parts["the promotion gate"] = lambda: self._gate_loop(peers, heldout, regression)
        background = {name: asyncio.create_task(self._supervised(name, part)) for name, part in parts.items()}
        try:
            if c.mode == "async":
                await self._until_budget(observer)
            else:
                await self._sync_steps(peers, observer, heldout, regression)
        finally:
            self.record.wall_s = self.clock.elapsed()
            self.stop.set()
            for name, task in background.items():
                # The worker lets running groups finish (its drain_timeout_s, 30 s) before it returns.
                await _stopped(task, name, say=self.say,
                               timeout_s=60.0 if task is background["the rollout worker"] else 15.0)
            await observer.stop()
        await self._measure_trainer_idle(peers)
        if self.interrupted:
            await self._checkpoint(peers)
        else:
            await self._finish(peers, heldout, regression)

    async def _baseline(self, peers, heldout, regression) -> None:
        """The version the fleet serves before RL: 0 on a new platform, the accepted one on a platform
        attached to after earlier runs."""

        status = await _rpc(peers.broker.GetStatus, broker_pb2.GetStatusRequest())
        fleet = [e.policy_version for e in status.engines if e.pool == "fleet"]
        version = min(fleet) if fleet else 0
        trainer = await _rpc(peers.trainer.GetStatus, trainer_pb2.GetStatusRequest(), timeout_s=30)
        self.state.start_version = max(0, trainer.policy_version)
        self.record.accepted_version = self.last_gated = version
        self.say(f"baseline: evaluating version {version} on {len(heldout)} held-out and {len(regression)} "
            f"regression tasks ...")
        # A stop during the baseline abandons it (Stopped): a resumed run evaluates it again.
        baseline = await self._unless_stopped(
            self._evaluate(peers, heldout, version, "heldout", "baseline", "fleet"))
        self.accepted_regression = await self._unless_stopped(
            self._evaluate(peers, regression, version, "regression", "baseline", "fleet")) \
            if regression else None
        self.accepted_eval = baseline
        self.say(f"baseline: held-out success {self.accepted_eval.success:.3f}")
        for result in (self.accepted_eval, self.accepted_regression):
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

    def _tasks(self, peers):
        c = self.config
        train = generate_tasks(c.suite, "train", 2000, seed=c.seed, difficulty=c.difficulty)
        heldout = generate_tasks(c.suite, "heldout", c.eval.heldout, seed=c.seed, difficulty=c.difficulty)
        regression = generate_tasks(c.suite, "regression", c.eval.regression, seed=c.seed,
                                    difficulty=c.difficulty) if c.eval.regression else []
        write_for_verifier(train + heldout + regression, self.run_dir / "suites")
        as_messages = lambda tasks: task_messages(tasks, c.run_id, 1, c.eval.temperature, c.system_prompt)  # noqa: E731
        return train, as_messages(heldout), as_messages(regression)

    def _worker(self, peers):
        c, platform = self.config, peers.platform
        delay = latency_sampler(c.rollout.tool_latency, c.seed)
        environments = self._environments()
        if c.rollout.tool_latency.distribution != "none":
            environments = lambda suite, plain=environments: SlowTools(plain(suite), delay)  # noqa: E731
        config = WorkerConfig(run_id=c.run_id,
                              nats=platform.worker_nats.model_dump(),
                              session_address=platform.session, sandbox_address=platform.sandbox,
                              verifier_address=platform.verifier,
                              concurrency=c.rollout.concurrency, tool_runtime=c.rollout.tool_runtime,
                              tool_call_format=c.rollout.tool_call_format,
                              observation_framing=c.rollout.observation_framing, metrics={"enabled": False})
        return RolloutWorker(config, environments=environments, clients=peers.clients,
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

    def _environments(self):
        """Environments with the run's tool runtime, for training episodes and evaluations alike
        (without the slow-tool latency: it models the training fleet's tools, not the scoring)."""

        return environments(self.config.rollout.tool_runtime)

    async def _evaluate(self, peers, tasks, version: int, split: str, label: str, pool: str,
                        keep: bool = True):
        c = self.config
        result = await evaluate(peers.clients, tasks, version=version, split=split, label=label, pool=pool,
                                concurrency=c.eval.concurrency, clock=self.clock,
                                environments=self._environments(), seed=c.seed if c.eval.seeded else None,
                                tag=f"{label}-v{version}-{split}-{time.monotonic_ns()}")
        if keep:
            self.record.evals.append(result)
        return result

    async def _admit_up_to(self, peers, trainer_version: int) -> None:
        await _rpc(peers.gateway.SetAdmissionPolicy, gateway_pb2.AdmissionPolicy(
            max_inflight_sessions=self.config.rollout.max_inflight_sessions, trainer_version=trainer_version,
            max_staleness=self.config.rollout.max_staleness))

    async def _follow_versions(self, peers, observer) -> None:
        """Moves the gateway's admission (staleness bound) along with each new trainer version."""
        admitted = observer.latest_version
        while not self.stop.is_set():
            if observer.latest_version > admitted:
                version = observer.latest_version
                await self._admit_up_to(peers, version)
                admitted = version
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), 0.2)

    def _budget_spent(self, observer) -> bool:
        budget = self.config.budget
        return (observer.latest_version - self.state.start_version >= budget.max_steps
                or self.clock.elapsed() >= budget.max_minutes * 60)

    async def _until_budget(self, observer) -> None:
        while not self.stop.is_set() and not self._budget_spent(observer):  # noqa: ASYNC110 - a clock, not an event
            await asyncio.sleep(0.5)

    async def _sync_steps(self, peers, observer, heldout, regression) -> None:
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
                if self.feeder.published - observer.groups_done <= 0:
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
            if c.gate.enabled and target - self.last_gated >= c.gate.every_versions:
                began = self.clock.elapsed()
                await self._gate(peers, target, heldout, regression)
                self.record.gate_wait_s += self.clock.elapsed() - began

    async def _wait_served(self, peers, version: int, pool: str, timeout_s: float = 120.0,
                           until_stopped: bool = True) -> bool:

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not (until_stopped and self.stop.is_set()):
            status = await _rpc(peers.broker.GetStatus, broker_pb2.GetStatusRequest())
            engines = [e for e in status.engines if e.pool == pool]
            if engines and all(e.policy_version >= version for e in engines):
                return True
            await asyncio.sleep(0.1)
        return False

    # -- the promotion gate ----------------------------------------------------------------------

    async def _gate_loop(self, peers, heldout, regression) -> None:
        if not self.config.gate.enabled:
            return
        while not self.stop.is_set():
            status = await _rpc(peers.broker.GetStatus, broker_pb2.GetStatusRequest())
            canary = [e.policy_version for e in status.engines if e.pool == "canary"]
            version = min(canary) if canary else 0
            if version >= self.last_gated + self.config.gate.every_versions:
                await self._gate(peers, version, heldout, regression)
            await asyncio.sleep(1.0)

    async def _gate(self, peers, version: int, heldout, regression) -> None:
        assert self.accepted_eval is not None  # the baseline, evaluated before the loop
        previous, self.last_gated = self.last_gated, version
        try:
            candidate, decision = await self._unless_stopped(
                self._evaluate_candidate(peers, heldout, version))
            cand_reg = await self._unless_stopped(
                self._evaluate(peers, regression, version, "regression", "candidate", "canary")) \
                if regression and decision is None else None
        except Stopped:
            self.last_gated = previous  # not decided: a resumed run gates this version again
            self.say(f"gate: evaluation of version {version} abandoned (stopping)")
            return
        decision = decision or decide(self.config.gate, candidate, self.accepted_eval, cand_reg,
                                      self.accepted_regression)
        if (decision.accepted
                and not await self._verifier_trusted(peers, f"before promoting version {version}")):
            decision.accepted = False
            decision.reasons.append("not promoted: the verifier failed its audit")
        self.record.gate.append(GateDecision(version, decision.accepted, decision.reasons,
                                             self.clock.elapsed(), decision.check_dicts(), decision.tasks,
                                             decision.early))
        verdict = "accepted" if decision.accepted else "refused"
        self.say(f"gate: version {version} {verdict}:\n  " + "\n  ".join(decision.reasons))
        if decision.accepted:
            await _rpc(peers.broker.Promote,
                       broker_pb2.PromoteRequest(version=version, reason="; ".join(decision.reasons)))
            self.accepted_eval, self.accepted_regression = candidate, cand_reg
            self.record.accepted_version = version
        self._account_long_tail()
        await self.save_state()

    async def _evaluate_candidate(self, peers, heldout, version: int) -> tuple[EvalResult, Decision | None]:
        """The candidate on the held-out set in the gate's slices, paired with the accepted version's
        kept per-task results (same tasks, same seeds: see `eval.seeded`); stops at the first slice
        after which the gate can already refuse. Returns the evaluation and that refusal, or None."""
        assert self.accepted_eval is not None  # the baseline, evaluated before the loop
        parts, early = [], None
        for start, end in slices(len(heldout), self.config.gate.looks):
            parts.append(await self._evaluate(peers, heldout[start:end], version, "heldout", "candidate",
                                              "canary", keep=False))
            if end < len(heldout) and (early := interim(self.config.gate, merge(parts), self.accepted_eval)):
                break
        result = merge(parts)
        self.record.evals.append(result)
        return result, early

    # -- the stop rules (stop_rules.py) ---------------------------------------------------------

    def _audit_set(self) -> list[dict]:
        """The labelled audit set (written once into the run directory by the verifier's own
        command), its tasks added to the suites the run's verifier reads; the subset each audit sends."""
        c = self.config.audit
        where = self.run_dir / "audit_set"
        labels = where / "labels.jsonl"
        if not labels.exists():
            subprocess.run([sys.executable, "-m", "rlfleet.verifier.audit_set", "write", str(where),
                            "--seed", str(c.seed)], check=True, capture_output=True, timeout=300)
        try:
            tasks = [t for suite in sorted((where / "suites").glob("*.jsonl"))
                     for t in load_tasks(str(suite))]
            write_for_verifier(tasks, self.run_dir / "suites")
        except SubmitError as exc:
            raise StartupError(f"the verifier audit set does not fit this run's suites: {exc}") from None
        return audit_subset([json.loads(line) for line in labels.read_text().splitlines() if line.strip()],
                            c.episodes, c.seed)

    async def _verifier_trusted(self, peers, when: str) -> bool:
        """Audits the run's verifier (`audit.*`); when a rate passes its threshold the run stops,
        with the reason on screen, in the report and in the run state."""
        c = self.config.audit
        if not c.enabled:
            return True
        if not self.audit_labels:
            self.audit_labels = await asyncio.to_thread(self._audit_set)
        request = verifier_pb2.AuditRequest(episodes=[verifier_pb2.LabelledEpisode(
            suite=e.get("suite", ""), task_id=e["task_id"], final_answer=e.get("final_answer", ""),
            files={k: v.encode() for k, v in e.get("files", {}).items()}, transcript=e.get("transcript", ""),
            human_passed=e["human_passed"], episode_id=e.get("episode_id", "")) for e in self.audit_labels])
        report = await _rpc(peers.verifier.Audit, request, timeout_s=c.timeout_s, within_s=2 * c.timeout_s)
        result = audit_result(report, when, c)
        self.record.audits.append(asdict(result))
        self.say(result.line())
        if not result.breaches:
            return True
        self.record.stop_rule = f"verifier audit {when}: " + "; ".join(result.breaches)
        self.interrupted = f"stop rule: {self.record.stop_rule}"
        self.say(f"stop rule: {self.record.stop_rule}; stopping the run (disagreements: "
            f"{', '.join(result.disagreements) or '-'})")
        self.stop.set()
        return False

    def _account_long_tail(self) -> None:
        c = self.config.long_tail
        baseline = next((e for e in self.record.evals if e.label == "baseline" and e.split == "heldout"),
                        None)
        if not c.enabled or baseline is None or self.accepted_eval is None:
            return
        account = long_tail(self.record.trajectories, max_staleness=self.config.rollout.max_staleness,
                            eval_retried=sum(e.retried for e in self.record.evals),
                            gain=self.accepted_eval.success - baseline.success, config=c)
        # The trainer's own count of what it did not train, by reason, beside the driver's account.
        self.record.long_tail = account.as_dict() | {"trainer_dropped": dict(self.trainer_dropped)}
        if not account.fired or self.record.stop_rule:
            return
        self.record.stop_rule = account.message
        self.record.notes.append(f"stop rule: {account.message}")
        if c.action == "stop":
            self.say(f"stop rule: {account.message}; stopping the loop (long_tail.action = \"stop\")")
            self.stop.set()
        else:
            self.say(f"stop rule: {account.message} (reported only: long_tail.action = \"report\")")

    async def _unless_stopped(self, work):
        """`await work`, abandoned (cancelled, `Stopped` raised) as soon as the stop is set: an
        orderly stop never waits for an evaluation to run out its retries."""
        task = asyncio.ensure_future(work)
        stopping = asyncio.ensure_future(self.stop.wait())
        try:
            await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(task, 30.0)  # its episodes abort their sessions, each bounded
        raise Stopped

    # -- watching and printing -------------------------------------------------------------------

    async def _watch_pauses(self, peers) -> None:
        updates: dict[str, int] = {}
        while not self.stop.is_set():
            try:
                status = await _rpc(peers.broker.GetStatus, broker_pb2.GetStatusRequest())
            except Exception:  # the broker restarting: try again next round
                await asyncio.sleep(1.0)
                continue
            for engine in status.engines:
                if engine.updates > updates.get(engine.engine_id, 0):
                    updates[engine.engine_id] = engine.updates
                    self.record.weight_pauses_s.append(engine.last_pause_s)
            await asyncio.sleep(0.5)

    async def _measure_trainer_idle(self, peers) -> None:
        """Adds the trainer's data-wait time since the last reading to the loop's account (its own
        counter, so the baseline evaluation before the loop does not count as idle)."""

        try:
            url = peers.platform.trainer_metrics_url
            if not url:
                return
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=3).read().decode())
        except OSError:
            return  # a trainer that is gone: its share of the loop is not measured
        self.trainer_dropped = trainer_dropped(text) or self.trainer_dropped
        waited = next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("rlfleet_trainer_data_wait_seconds_total")), None)
        if waited is None:
            return
        now = self.clock.elapsed()
        if self._trainer_mark is not None and waited >= self._trainer_mark[0]:
            self.record.trainer_wait_s += waited - self._trainer_mark[0]
            self.record.trainer_watched_s += now - self._trainer_mark[1]
            if self.record.trainer_watched_s > 0:
                # The counter grows when a wait ends, so a reading can hold waiting from before the
                # last one: over the whole loop the ratio is exact, between two readings it can pass 1.
                self.record.trainer_idle_fraction = min(1.0, self.record.trainer_wait_s
                                                        / self.record.trainer_watched_s)
        self._trainer_mark = (waited, now)

    async def _progress(self, peers, observer) -> None:
        assert self.accepted_eval is not None  # the baseline, evaluated before the loop
        while not self.stop.is_set():
            await asyncio.sleep(5.0)
            try:
                status = await peers.trainer.GetStatus(trainer_pb2.GetStatusRequest(), timeout=5)
            except grpc.aio.AioRpcError as exc:
                self.say(f"[{self.clock.elapsed():5.0f}s] the trainer is not answering ({exc.code().name}); "
                    f"see {self.run_dir / 'logs' / 'trainer.log'}")
                continue
            await self._measure_trainer_idle(peers)
            recent = [t for t in self.record.trajectories[-200:] if t.split == "train"]
            reward = sum(t.reward for t in recent) / len(recent) if recent else 0.0
            stale = max((t.staleness for t in recent), default=0)
            pauses = sorted(self.record.weight_pauses_s[-20:])
            pause = pauses[len(pauses) // 2] * 1000 if pauses else 0.0
            rate = observer.train_trajectories / max(self.clock.elapsed(), 1e-9)
            self.say(f"[{self.clock.elapsed():5.0f}s] step {status.step:3d}  v{status.policy_version:<3d} "
                f"reward {reward:.2f}  held-out {self.accepted_eval.success:.2f} "
                f"(accepted v{self.record.accepted_version})  "
                f"staleness max {stale}  {rate:.1f} traj/s  pause p50 {pause:.0f} ms  "
                f"trainer idle {self.record.trainer_idle_fraction:.0%}")

    async def _finish(self, peers, heldout, regression) -> None:
        self._account_long_tail()
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

    async def _checkpoint(self, peers) -> None:
        """After an interruption: make every step taken durable, so a resume retrains nothing."""

        try:
            done = await peers.trainer.Checkpoint(trainer_pb2.CheckpointRequest(), timeout=60)
            self.say(f"checkpoint: step {done.step}, version {done.policy_version}")
        except grpc.aio.AioRpcError as exc:
            # A trainer that is gone keeps its last checkpoint; the steps after it are redone from
            # the trajectories JetStream still holds for it, exactly once.
            self.record.notes.append(f"no checkpoint at the interruption ({exc.code().name}): the trainer "
                                     "resumes from its last one")

    async def _supervised(self, name: str, part) -> None:
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

    def _print_summary(self, summary: dict) -> None:
        rows = summary["baseline_vs_rl"]
        self.say("")
        self.say(f"run {summary['run_id']} ({summary['mode']}): {summary['steps']} steps in "
            f"{summary['wall_s']:.0f} s, accepted version {summary['accepted_version']}")
        for name, row in rows.items():
            self.say(f"  {name:12s} held-out success {row['task_success']:.3f}  invalid tool calls/ep "
                f"{row['invalid_tool_calls_per_episode']:.3f}  time {row['time_to_completion_s']:.2f} s  "
                f"turns {row['interactions_per_episode']:.2f}  "
                f"safety {row['safety_violations_per_episode']:.3f}")
        for d in summary["gate"]:
            success = next((c for c in d.get("checks", []) if c["name"] == "held-out success"), None)
            interval = (f" gain {success['estimate']:+.3f} [{success['low']:+.3f}, {success['high']:+.3f}]"
                        if success else "")
            refused = [c["name"] for c in d.get("checks", []) if not c["passed"]]
            self.say(f"  gate v{d['version']:<4d} {'accepted' if d['accepted'] else 'refused '} "
                f"on {d.get('tasks', 0)} paired tasks{' (early)' if d.get('early') else ''}:{interval}"
                + (f"  refused by: {', '.join(refused)}" if refused else ""))
        for audit in summary["verifier_audits"]:
            self.say(f"  verifier audit ({audit['when']}): n {audit['n']}  "
                f"FP rate {audit['false_positive_rate']:.3f}  FN rate {audit['false_negative_rate']:.3f}")
        if summary["long_tail"]:
            self.say(f"  long tail: {summary['long_tail']['message']}")
        if summary["stop_rule"]:
            self.say(f"  stop rule: {summary['stop_rule']}")
        episodes = summary.get("episodes") or {}
        if episodes:
            tools = ", ".join(f"{t} {n:.2f}" for t, n in episodes["tool_calls_per_episode"].items())
            phases = episodes["phase_s_per_episode"]
            self.say(f"  tool calls per episode ({episodes['episodes']} training episodes): "
                f"{tools or 'none'}")
            self.say(f"  time per episode: sandbox create+destroy {phases['sandbox_create_destroy']:.2f} s, "
                f"tool execs {phases['tool_execs']:.2f} s, generation {phases['generation']:.2f} s, "
                f"verification {phases['verification']:.2f} s "
                f"(sandbox time p50 {episodes['sandbox_s_per_episode']['p50']:.2f} s)")
            for bucket in episodes["verifier_reasons_over_time"]:
                reasons = ", ".join(f"{k} {v}" for k, v in sorted(bucket["reasons"].items())) or "none"
                self.say(f"  [{bucket['from_s']:5.0f}s] {bucket['passed']}/{bucket['episodes']} passed; "
                    f"failure reasons: {reasons}")
        self.say(f"report: {self.run_dir / 'report.html'}  summary: {self.run_dir / 'summary.json'}")


async def _stopped(task: asyncio.Task, what: str, timeout_s: float = 90.0,
                   say: Callable[[str], None] = say) -> None:
    """Waits for a background task that was told to stop; one that failed says so (never silently),
    one that does not stop in time is cancelled."""
    try:
        await asyncio.wait_for(asyncio.shield(task), timeout_s)
    except TimeoutError:
        task.cancel()
        say(f"{what} did not stop within {timeout_s:.0f} s; cancelled it")
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    except asyncio.CancelledError:
        if not task.done():
            task.cancel()
        raise
    except Exception as exc:  # reported, not swallowed
        say(f"{what} failed: {type(exc).__name__}: {exc}")
        log.error("%s failed", what, exc_info=exc)


RPC_TIMEOUT_S = 10.0
PLATFORM_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


async def _rpc(method, request, *, timeout_s: float = RPC_TIMEOUT_S, within_s: float = 120.0):
    """One call to a platform service, with a deadline. A peer that is down or restarting
    (UNAVAILABLE, DEADLINE_EXCEEDED) is called again with backoff bounded to 2 s, for `within_s` at
    most (the supervisor brings it back meanwhile); any other status is raised at once."""
    deadline = time.monotonic() + within_s
    delay = 0.25
    while True:
        try:
            return await method(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in PLATFORM_CODES or time.monotonic() + delay > deadline:
                raise
        await asyncio.sleep(delay)
        delay = min(delay * 2, 2.0)


def trainer_dropped(metrics_text: str) -> dict[str, float]:
    """`rlfleet_trainer_dropped_trajectories_total` by its `reason` label, from a Prometheus text page."""
    found: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("rlfleet_trainer_dropped_trajectories_total{") and 'reason="' in line:
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            found[reason] = found.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def platform_differences(running: dict, wanted: dict) -> list[str]:
    """What in the running platform's launch config would make it a different platform for this run."""
    keys = ("run_id", "engines", "canary_engines", "model_path", *SECTIONS.values())
    have = dict(flatten_keys({k: running.get(k) for k in keys}))
    need = dict(flatten_keys({k: wanted.get(k) for k in keys}))
    return [f"{key}: running {have.get(key)!r}, this run needs {need.get(key)!r}"
            for key in sorted(set(have) | set(need)) if have.get(key) != need.get(key)]


