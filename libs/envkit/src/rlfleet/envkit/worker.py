"""The rollout worker: tasks from TASKS in, groups of published trajectories out.

    connect to NATS and the services; join the run's durable TASKS consumer
    while not stopped (or until n tasks are done, or the queue stays empty):
        wait for a free episode slot
        take the next task delivery
        run it in the background: a group of G episodes, heartbeating the delivery
            all G published      -> ack
            a sample unfinished  -> redeliver later (dead-letter after max_deliver)
            a service outage     -> hold the delivery (heartbeats), wait for the services to answer,
                                    run the stopped samples again in it: no delivery is used up
            undecodable/unknown  -> dead-letter at once, counted by reason
    on stop: let running groups finish for drain_timeout_s, abort the rest (their tasks are redelivered)

Embed it (`await RolloutWorker(config).run(stop_event)`, `run_until(n_tasks)`, `drain()`), or run
it as a process with `rlfleet-worker`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import nats

from rlfleet.api.common.v1 import common_pb2
from rlfleet.common.errors import StartupError
from rlfleet.common.grpc_server import check_health
from rlfleet.common.queue_metrics import QueueDepthPoller
from rlfleet.common.streams import connect_nats, ensure_streams
from rlfleet.envkit.groups import MAX_OUTAGE_ATTEMPTS, GroupResult, GroupRunner, group_id_of, session_id_key
from rlfleet.envkit.sdk.clients import Clients
from rlfleet.envkit.sdk.environment import Environment, known_suites
from rlfleet.envkit.sdk.environment import environments as environments_for_runtime
from rlfleet.envkit.sdk.episode import AgentLoop, EpisodeHooks, is_platform_failure
from rlfleet.envkit.sdk.errors import RpcError
from rlfleet.envkit.sdk.framing import framing_for
from rlfleet.envkit.sdk.retry import Backoff
from rlfleet.envkit.sdk.summary import EpisodeSummary
from rlfleet.envkit.task_queue import TASKS, Delivery, MaxDeliveriesWatch, TaskQueue
from rlfleet.envkit.tasks import BadTask, decode_task
from rlfleet.envkit.worker_config import WorkerConfig
from rlfleet.envkit.worker_metrics import WorkerMetrics

log = logging.getLogger(__name__)
FETCH_WAIT_S = 0.5


@dataclass
class WorkerStats:
    tasks_acked: int = 0
    tasks_dead_lettered: int = 0
    tasks_retried: int = 0
    tasks_superseded: int = 0
    outage_reruns: int = 0  # groups run again inside their delivery after a service outage
    bad_tasks: Counter = field(default_factory=Counter)  # by reason
    episodes: Counter = field(default_factory=Counter)  # by outcome
    recent: deque = field(default_factory=lambda: deque(maxlen=10_000))  # EpisodeSummary, newest last

    @property
    def tasks_done(self) -> int:
        """Task messages this worker settled for good: acked, or dead-lettered (unfinished or bad)."""
        return self.tasks_acked + self.tasks_dead_lettered + sum(self.bad_tasks.values())


def worker_token(config: WorkerConfig) -> str:
    """The token the worker calls with: `token`, else the contents of `token_file`, else none (then
    the environment's, `Clients.connect`)."""
    if config.token or not config.token_file:
        return config.token
    try:
        return Path(config.token_file).read_text().strip()
    except OSError as exc:
        raise StartupError(f"cannot read the worker's token_file {config.token_file}: {exc}") from None


class RolloutWorker:
    def __init__(self, config: WorkerConfig, *, environments: Callable[[str], Environment] | None = None,
                 suites: list[str] | None = None, clients: Clients | None = None,
                 on_episode: Callable[[EpisodeSummary], None] | None = None) -> None:
        self.config = config
        self.environments = environments or environments_for_runtime(config.tool_runtime)
        self.suites = suites or known_suites()
        self.clients = clients
        self.on_episode = on_episode
        self.stats = WorkerStats()
        self.metrics = WorkerMetrics()
        self._pending = 0  # episodes of in-flight groups not finished yet
        self._changed = asyncio.Event()  # pending episodes or in-flight groups changed
        self._groups: set[asyncio.Task] = set()
        self.nc: nats.NATS | None = None
        self.queue: TaskQueue | None = None
        self.watch: MaxDeliveriesWatch | None = None
        self.runner: GroupRunner | None = None
        self.depth: QueueDepthPoller | None = None
        self._own_clients = False

    # -- the loop ----------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event | None = None, *, max_tasks: int | None = None,
                  idle_exit_s: float | None = None) -> WorkerStats:
        """Consumes tasks until `stop` is set, `max_tasks` are done, or nothing came for `idle_exit_s`."""
        stop = stop or asyncio.Event()
        if self.queue is None:
            try:
                await self.start()
            except BaseException:
                await self.shutdown()
                raise
        assert self.queue is not None  # start() made it
        idle_since = time.monotonic()
        try:
            while not stop.is_set() and not self._reached(max_tasks):
                if not await self._wait_for_capacity(stop, max_tasks):
                    continue
                delivery = await self.queue.next(FETCH_WAIT_S)
                if delivery is not None or self._groups:
                    idle_since = time.monotonic()
                if delivery is not None:
                    self._spawn(self.handle(delivery))
                elif idle_exit_s is not None and time.monotonic() - idle_since >= idle_exit_s:
                    break
        finally:
            await self.shutdown()
        return self.stats

    async def run_forever(self, stop: asyncio.Event) -> WorkerStats:
        return await self.run(stop)

    async def run_until(self, n_tasks: int, stop: asyncio.Event | None = None) -> WorkerStats:
        return await self.run(stop, max_tasks=n_tasks)

    async def drain(self, idle_s: float = 2.0) -> WorkerStats:
        """Runs until the queue has been empty, with nothing in flight, for `idle_s`."""
        return await self.run(idle_exit_s=idle_s)

    async def handle(self, delivery: Delivery) -> None:
        """One delivery, from decoding to settling."""
        try:
            task = self.prepare(decode_task(delivery.msg.data, self.config.run_id, self.suites))
        except BadTask as bad:
            self.stats.bad_tasks[bad.reason] += 1
            self.metrics.bad_tasks.add(1, {"reason": bad.reason})
            await delivery.dead_letter(str(bad))
            return
        unfinished = task.group_size
        self._add_pending(unfinished)

        def episode_done(summary: EpisodeSummary) -> None:
            nonlocal unfinished
            unfinished -= 1
            self._add_pending(-1)  # frees its slot now, not when the whole group is done
            self._episode_done(summary)

        assert self.runner is not None, "start() first"
        try:
            async with delivery.heartbeat(self.config.heartbeat_s):
                outage = 0
                while True:
                    try:
                        result = await self.runner.run(task, delivery.sequence, delivery.number, episode_done,
                                                       outage)
                    except RpcError as exc:
                        # a peer failed before the episodes could run (the session server is down)
                        log.warning("group of task #%d could not run: %s", delivery.sequence, exc)
                        result = GroupResult(group_id_of(task.task_id, delivery.sequence),
                                             unfinished=[f"group: {exc}"],
                                             platform_failures=int(is_platform_failure(exc)))
                    if not result.platform_outage or outage >= MAX_OUTAGE_ATTEMPTS:
                        break
                    # A peer down or restarting stopped some samples: not the task's fault, so no
                    # delivery is spent on it. Wait for the services, then run those samples again.
                    outage += 1
                    self.stats.outage_reruns += 1
                    log.info("group of task #%d stopped by a service outage (%s); running "
                             "it again (attempt %d)",
                             delivery.sequence, "; ".join(result.unfinished)[:300], outage)
                    await self.wait_for_platform(outage)
                    again = len(result.unfinished) if result.episodes else 0  # their episodes ended
                    unfinished += again
                    self._add_pending(again)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.shield(delivery.retry_later(0))  # stopping: let another worker have it now
            raise
        finally:
            self._add_pending(-unfinished)
        await self.settle(delivery, result)

    async def wait_for_platform(self, attempt: int) -> bool:
        """Waits out a service outage: a pause that doubles with each attempt up to
        `platform_backoff_max_s` (what is behind the session server, the gateway and its engines, is
        not probed from here), then until every service an episode calls answers its health check,
        for at most `platform_wait_s`."""
        config = self.config
        await asyncio.sleep(min(config.platform_backoff_max_s, 0.25 * 2 ** attempt))
        addresses = [a for a in (config.session_address, config.sandbox_address,
                                 config.verifier_address) if a]
        deadline = time.monotonic() + config.platform_wait_s
        for delay in Backoff(0.2, config.platform_backoff_max_s).delays():
            answers = await asyncio.gather(*(check_health(a, timeout_s=2.0) for a in addresses))
            if all(answers):
                return True
            if time.monotonic() + delay > deadline:
                log.warning("services still down after %.0f s: running the samples anyway",
                            config.platform_wait_s)
                return False
            await asyncio.sleep(delay)
        return False

    async def settle(self, delivery: Delivery, result: GroupResult) -> None:
        if result.superseded:
            outcome = "superseded"  # a newer delivery owns the task; leave the message to it
            self.stats.tasks_superseded += 1
        elif result.complete:
            outcome = "acked"
            await delivery.ack()
            self.stats.tasks_acked += 1
        elif delivery.last_chance:
            outcome = "dead_lettered"
            await delivery.dead_letter(f"group {result.group_id} unfinished "
                                       f"after {delivery.number} deliveries: "
                                       + "; ".join(result.unfinished))
            self.stats.tasks_dead_lettered += 1
        else:
            outcome = "retried"
            await delivery.retry_later(self.config.nak_delay_s * delivery.number)
            self.stats.tasks_retried += 1
        self.metrics.tasks.add(1, {"result": outcome})
        log.info("task %s %s", result.group_id, outcome,
                 extra={"group_id": result.group_id, "episodes": len(result.episodes),
                        "skipped": result.skipped, "unfinished": result.unfinished})

    def prepare(self, task: common_pb2.Task) -> common_pb2.Task:
        """Fills what the task leaves to the worker (run, group size, time limit) and checks the bounds."""
        config = self.config
        task.run_id = task.run_id or config.run_id
        task.group_size = task.group_size or config.default_group_size
        if task.group_size > config.max_group_size:
            raise BadTask("group_too_large", f"task {task.task_id} asks for {task.group_size} samples; "
                                             f"this worker runs at most {config.max_group_size}")
        timeout = task.episode_timeout_s or config.episode_timeout_s
        task.episode_timeout_s = min(timeout, config.max_episode_timeout_s)
        return task

    # -- start, stop -------------------------------------------------------------------------------

    async def start(self) -> None:
        config = self.config
        if self.clients is None:  # first: a missing address fails fast, before anything connects
            self.clients = Clients.connect(session=config.session_address, sandbox=config.sandbox_address,
                                           verifier=config.verifier_address, token=worker_token(config),
                                           ca_file=config.ca_file)
            self._own_clients = True
        # NATS is TLS too, checked against the same CA as the services (a worker holds no certificate).
        nats_config = config.nats if config.nats.ca_file or not config.ca_file else \
            config.nats.model_copy(update={"ca_file": config.ca_file})
        self.nc = await connect_nats(nats_config, f"rlfleet-worker-{config.run_id}")
        js = self.nc.jetstream()
        await ensure_streams(js)
        self.queue = TaskQueue(js, config.run_id, config.consumer, ack_wait_s=config.effective_ack_wait_s,
                               max_deliver=config.max_deliver)
        await self.queue.start()
        self.depth = QueueDepthPoller(js, TASKS, self.queue.durable)
        self.depth.start()
        self.watch = MaxDeliveriesWatch(self.nc, self.queue)
        await self.watch.start()
        admission = Backoff(config.admission.first_backoff_s, config.admission.max_backoff_s,
                            give_up_after_s=config.admission.give_up_after_s)
        hooks = EpisodeHooks(
            on_admission_retry=lambda exc: self.metrics.admission_retries.add(1),
            on_tool_result=lambda call, result, waited: self.metrics.tool_wait.record(waited))
        loop = AgentLoop(self.clients, environments=self.environments, admission=admission, hooks=hooks,
                         framing=framing_for(config.observation_framing),
                         tool_call_format=config.tool_call_format)
        self.runner = GroupRunner(loop, self.clients.session, asyncio.Semaphore(config.concurrency),
                                  sampling=config.sampling, max_total_tokens=config.max_total_tokens,
                                  id_key=session_id_key(self.clients.credentials))
        log.info("consuming tasks", extra={"run_id": config.run_id, "consumer": self.queue.durable,
                                           "concurrency": config.concurrency})

    async def shutdown(self) -> None:
        if self._groups:
            _done, running = await asyncio.wait(self._groups, timeout=self.config.drain_timeout_s)
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
        if self.watch is not None:
            await self.watch.stop()
        if self.depth is not None:
            await self.depth.stop()
            self.depth = None
        if self.queue is not None:
            await self.queue.stop()
        if self.clients is not None and self._own_clients:
            await self.clients.close()
            self.clients = None
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.drain(), 3.0)
            self.nc = None
        self.queue = None

    # -- bookkeeping -------------------------------------------------------------------------------

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._groups.add(task)
        task.add_done_callback(self._group_done)

    def _group_done(self, task: asyncio.Task) -> None:
        self._groups.discard(task)
        self._wake()
        if not task.cancelled() and task.exception() is not None:
            log.error("task handler crashed", exc_info=task.exception())

    def _episode_done(self, summary: EpisodeSummary) -> None:
        self.metrics.episode(summary)
        self.stats.episodes[summary.outcome] += 1
        self.stats.recent.append(summary)
        if self.on_episode is not None:
            self.on_episode(summary)

    def _add_pending(self, delta: int) -> None:
        """Episodes waiting or running; a finished group gives back what its episodes did not."""
        self._pending += delta
        self.metrics.in_flight.add(delta)
        self._wake()

    def _wake(self) -> None:
        self._changed.set()

    async def _wait_for_capacity(self, stop: asyncio.Event, max_tasks: int | None) -> bool:
        """Whether to fetch a task now: a free episode slot and, with `max_tasks`, a task still to take.
        Waits briefly for a change first, so the caller re-checks its stop conditions often."""
        def free() -> bool:
            if max_tasks is not None and self.stats.tasks_done + len(self._groups) >= max_tasks:
                return False
            return self._pending < self.config.concurrency
        if free():
            return True
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), FETCH_WAIT_S)
        return free() and not stop.is_set()

    def _reached(self, max_tasks: int | None) -> bool:
        return max_tasks is not None and self.stats.tasks_done >= max_tasks
