"""The pieces of the RL loop driver: tasks in, observations out, evaluations, CPU samples.

Each piece is small and talks to the platform only through its public surfaces: TASKS, TRAJECTORIES
and POLICY on JetStream, and the services' gRPC APIs.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nats.errors import Error as NatsError

from rlfleet.api.common.v1 import common_pb2
from rlfleet.cli.report import EvalResult, RunRecord, TaskOutcome, TrajectoryRecord
from rlfleet.cli.run_config import ToolLatencyConfig
from rlfleet.common.streams import ORDERED_HEARTBEAT_S, publish, subject
from rlfleet.envkit.actions import ToolCall
from rlfleet.envkit.sdk.environment import Environment, SandboxHandle, ToolResult, environment_for
from rlfleet.envkit.sdk.episode import AgentLoop, EpisodeSpec
from rlfleet.envkit.tasks import task_message

if TYPE_CHECKING:
    from nats.js import JetStreamContext

log = logging.getLogger(__name__)
PLATFORM_RETRIES = 5  # runs of one evaluation episode that a service outage may stop before it counts


class Clock:
    """Loop time: seconds since the loop started, counting what earlier parts of a resumed run used."""

    def __init__(self, already_s: float = 0.0) -> None:
        self.start = time.monotonic() - already_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start


# ---------------------------------------------------------------------------------------------
# Tasks


def task_messages(tasks, run_id: str, group_size: int, temperature: float, system_prompt: bool):
    """The public view of each task as the `Task` message a worker receives."""

    messages = []
    for task in tasks:
        message = task_message(task, run_id, group_size=group_size, temperature=temperature)
        if not system_prompt:
            keep = [m for m in message.messages if m.role != "system"]
            del message.messages[:]
            message.messages.extend(keep)
        messages.append(message)
    return messages


class Feeder:
    """Keeps the TASKS queue topped up with training tasks (async mode), or hands out one step's
    worth at a time (sync mode)."""

    def __init__(self, js, run_id: str, tasks: list[common_pb2.Task], *, attempt: str = "",
                 published: int = 0) -> None:
        self.js = js
        self.run_id = run_id
        self.tasks = tasks
        self.attempt = attempt
        self.published = published

    async def publish(self, n: int) -> None:
        for _ in range(n):
            task = self.tasks[self.published % len(self.tasks)]
            epoch = self.published // len(self.tasks)
            # The message ID names the run's attempt: a resumed run republishing the task it was
            # handing out when stopped is deduplicated, a new run on the same platform is not.
            await publish(self.js, "TASKS", self.run_id, task.SerializeToString(), msg_type="Task",
                          msg_id=f"{self.run_id}/{self.attempt}/{task.task_id}/e{epoch}")
            self.published += 1

    async def in_flight(self) -> int:
        """This run's tasks in TASKS: handed out and not finished. TASKS is a work queue, so a task
        leaves it when its worker acks it (every sample published, whatever its status) or
        dead-letters it, and a task redelivered after its worker died is still in it. Counting groups
        off TRAJECTORIES instead leaked a slot for every group that never showed all its samples
        there (a sample closed FAILED, a task dead-lettered, a group half published before a
        controller restart), until nothing was handed out at all."""
        name = subject("TASKS", self.run_id)
        info = await self.js.stream_info("TASKS", subjects_filter=name)
        return int((info.state.subjects or {}).get(name, 0))

    async def keep_topped_up(self, in_flight_target: int, stop: asyncio.Event,
                             room_ahead: Callable[[int], Awaitable[int]] | None = None) -> None:
        """Keeps `in_flight_target` groups in TASKS; with `room_ahead`, never more than it allows given
        the groups in TASKS (how many more groups may be handed out)."""
        while not stop.is_set():
            try:
                in_flight = await self.in_flight()
                missing = in_flight_target - in_flight
                if missing > 0 and room_ahead is not None:
                    missing = min(missing, await room_ahead(in_flight))
                if missing > 0:
                    # a task whose publish was not confirmed goes again under its message ID: once
                    await self.publish(missing)
            except (NatsError, TimeoutError) as exc:  # NATS restarting: its client reconnects
                log.info("handing out tasks waits for NATS (%s)", exc or type(exc).__name__)
            await asyncio.sleep(0.2)


# ---------------------------------------------------------------------------------------------
# Observing what the platform publishes


class Observer:
    """Follows TRAJECTORIES and POLICY from now on; fills the run record and tells listeners about
    new policy versions (admission control needs the trainer's version)."""

    def __init__(self, js, run_id: str, record: RunRecord, clock: Clock) -> None:
        self.js = js
        self.run_id = run_id
        self.record = record
        self.clock = clock
        self.latest_version = 0
        self.version_listeners: list[Callable[[common_pb2.PolicyVersion], None]] = []
        self.groups: dict[str, list[float]] = {}  # rewards of each group's samples so far
        self.groups_done = 0
        self.trainable_groups_done = 0  # complete groups whose rewards differ (GRPO trains on them)
        self.train_trajectories = 0
        self._subs: list[JetStreamContext.PushSubscription] = []

    async def start(self) -> None:
        from nats.js.api import DeliverPolicy

        self._subs.append(await self.js.subscribe(subject("TRAJECTORIES", self.run_id),
                                                  cb=self._on_trajectory, ordered_consumer=True,
                                                  idle_heartbeat=ORDERED_HEARTBEAT_S,
                                                  deliver_policy=DeliverPolicy.NEW))
        self._subs.append(await self.js.subscribe(subject("POLICY", self.run_id), cb=self._on_policy,
                                                  ordered_consumer=True, idle_heartbeat=ORDERED_HEARTBEAT_S,
                                                  deliver_policy=DeliverPolicy.ALL))

    async def stop(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()

    async def _on_policy(self, msg) -> None:
        version = common_pb2.PolicyVersion.FromString(msg.data)
        self.latest_version = max(self.latest_version, version.version)
        for listener in self.version_listeners:
            listener(version)

    async def _on_trajectory(self, msg) -> None:
        traj = common_pb2.Trajectory.FromString(msg.data)
        generated = [s for s in traj.spans if s.kind == common_pb2.SPAN_KIND_GENERATED]
        min_version = min((s.policy_version for s in generated), default=0)
        observations = [s for s in traj.spans if s.kind == common_pb2.SPAN_KIND_OBSERVATION]
        status = common_pb2.TrajectoryStatus.Name(traj.status).removeprefix("TRAJECTORY_STATUS_").lower()
        self.record.trajectories.append(TrajectoryRecord(
            elapsed_s=self.clock.elapsed(), length=len(traj.token_ids), generated=sum(traj.loss_mask),
            reward=traj.verdict.reward, passed=traj.verdict.passed, status=status,
            split=traj.split or "train", min_version=min_version,
            staleness=max(0, self.latest_version - min_version),
            tool_wait_s=traj.timings.tool_wait_s or sum(s.latency_s for s in observations),
            generate_latencies_s=[s.latency_s for s in generated]))
        if (traj.split or "train") == "train" and status in ("completed", "truncated"):
            self.train_trajectories += 1
            rewards = self.groups.setdefault(traj.group_id, [])
            rewards.append(traj.verdict.reward)
            if len(rewards) == (traj.group_size or 1):
                self.groups_done += 1
                self.trainable_groups_done += len(set(rewards)) > 1
                del self.groups[traj.group_id]


# ---------------------------------------------------------------------------------------------
# Evaluation


def eval_sampling(task: common_pb2.Task, seed: int | None) -> common_pb2.SamplingParams | None:
    """The task's sampling with a seed of its own, the same for every version evaluated on it (None:
    unseeded, the engine draws fresh randomness). Paired evaluations then differ in the weights only:
    the CPU engine's tokens depend on seed, prompt and parameters alone, SGLang's with
    `--enable-deterministic-inference`."""
    if seed is None:
        return None
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(task.sampling)
    digest = hashlib.sha256(f"eval:{seed}:{task.task_id}".encode()).digest()
    sampling.seed = int.from_bytes(digest[:8], "big") % 2**63
    return sampling


async def evaluate(clients, tasks: list[common_pb2.Task], *, version: int, split: str, label: str, pool: str,
                   concurrency: int, clock: Clock, tag: str, environments=None,
                   seed: int | None = None) -> EvalResult:
    """Runs each task once through the platform, pinned to an engine pool, scored by the verifier;
    with `seed`, each task samples with its own fixed seed (`eval_sampling`)."""

    loop = AgentLoop(clients, environments=environments or environment_for)
    slots = asyncio.Semaphore(concurrency)
    retried = 0

    async def one(i: int, task: common_pb2.Task):
        nonlocal retried
        # An episode a service outage stopped (a peer restarting) says nothing about the policy: it
        # runs again under a new session ID rather than count as a failure in the gate's figures.
        for attempt in range(PLATFORM_RETRIES + 1):
            session_id = f"eval-{tag}-{i}" + (f"-p{attempt}" if attempt else "")
            async with slots:
                spec = EpisodeSpec(task=task, session_id=session_id, group_id=session_id,
                                   sampling=eval_sampling(task, seed),
                                   metadata={"engine_pool": pool, "eval": label})
                summary = await loop.run(spec)
            if not summary.platform_failure:
                break
            retried += 1
            await asyncio.sleep(min(2.0, 0.5 * 2 ** attempt))
        return summary

    summaries = await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)))
    n = len(summaries) or 1
    outcomes = [TaskOutcome(task_id=t.task_id, passed=bool(s.passed), invalid_tool_calls=int(s.invalid_calls),
                            safety_violations=int(s.safety_violations), time_s=float(s.episode_s))
                for t, s in zip(tasks, summaries, strict=True)]
    return EvalResult(version=version, split=split, episodes=len(summaries), tasks=outcomes, retried=retried,
                      success=sum(s.passed for s in summaries) / n,
                      invalid_tool_calls=sum(s.invalid_calls for s in summaries) / n,
                      safety_violations=sum(s.safety_violations for s in summaries) / n,
                      time_to_completion_s=sum(s.episode_s for s in summaries) / n,
                      interactions=sum(s.turns for s in summaries) / n,
                      elapsed_s=clock.elapsed(), label=label)


# ---------------------------------------------------------------------------------------------
# Slow tools


def latency_sampler(config: ToolLatencyConfig, seed: int) -> Callable[[], float]:
    rng = random.Random(seed)
    if config.distribution == "none":
        return lambda: 0.0
    if config.distribution == "constant":
        return lambda: min(config.median_s, config.max_s)
    mu = math.log(max(config.median_s, 1e-6))
    return lambda: min(rng.lognormvariate(mu, config.sigma), config.max_s)


@dataclass
class SlowTools:
    """An environment whose tool calls take extra time drawn from a distribution (slow tools)."""

    inner: Environment
    delay: Callable[[], float]

    @property
    def suite(self) -> str:
        return self.inner.suite

    @property
    def tools(self) -> tuple[str, ...]:
        return self.inner.tools

    @property
    def needs_sandbox(self) -> bool:
        return getattr(self.inner, "needs_sandbox", True)

    async def setup(self, sandbox: SandboxHandle | None, task: common_pb2.Task) -> None:
        await self.inner.setup(sandbox, task)

    async def run_tool(self, sandbox: SandboxHandle | None, call: ToolCall) -> ToolResult:
        result = await self.inner.run_tool(sandbox, call)
        await asyncio.sleep(self.delay())
        return result


# ---------------------------------------------------------------------------------------------
# CPU


class CpuSampler:
    """CPU use and resident memory of every process of the run (services, engines, NATS, Redis, this
    driver)."""

    def __init__(self, pids: list[int], record: RunRecord, clock: Clock, interval_s: float = 2.0) -> None:
        import psutil

        self.processes = [psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)]
        self.processes.append(psutil.Process())
        self.record = record
        self.clock = clock
        self.interval_s = interval_s
        self.cores = psutil.cpu_count() or 1

    async def run(self, stop: asyncio.Event) -> None:
        import psutil

        for p in self.processes:
            try:
                p.cpu_percent(None)
            except psutil.Error:
                pass
        while not stop.is_set():
            await asyncio.sleep(self.interval_s)
            total, rss = 0.0, 0
            for p in self.processes:
                try:
                    total += p.cpu_percent(None)
                    rss += p.memory_info().rss
                except psutil.Error:
                    pass
            now = self.clock.elapsed()
            self.record.cpu.append((now, total / self.cores))
            self.record.memory_mb.append((now, rss / 2**20))
