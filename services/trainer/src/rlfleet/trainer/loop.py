"""The trainer's loop: consume → group → filter → batch → step → checkpoint → publish.

Exactly once, from the model's point of view: a trajectory's message is acked only after a
checkpoint that includes its training is durable. A crash before that loses the step on both sides
(the weights and the ledger roll back to the checkpoint) while JetStream redelivers the messages,
which are then trained again from the restored weights; a redelivery of anything the checkpoint
already includes is acked and skipped. Version numbers only move forward (see publisher.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from opentelemetry import trace

from rlfleet.common.telemetry import link_to
from rlfleet.trainer import startup
from rlfleet.trainer.checkpointer import Checkpointer, ServiceState
from rlfleet.trainer.filters import GroupFilters
from rlfleet.trainer.groups import GroupBuffer
from rlfleet.trainer.intake import Intake, ReadyGroup
from rlfleet.trainer.learner import Learner, Worker, model_limits
from rlfleet.trainer.ledger import TrainedLedger
from rlfleet.trainer.metrics import TrainerMetrics
from rlfleet.trainer.publisher import VersionPublisher
from rlfleet.trainer.service_config import TrainerConfig
from rlfleet.trainer.validation import Candidate, Limits

log = logging.getLogger(__name__)
tracer = trace.get_tracer("rlfleet.trainer")

REPORTED = ("loss", "pg_loss", "entropy", "clip_frac", "approx_kl", "kl", "grad_norm", "logprob_gap_mean",
            "logprob_gap_max", "tis_weight_mean", "tis_clip_frac", "reward_mean", "lr", "tokens",
            "loss_tokens", "seqs", "step_time_s", "rl_step_s", "tokens_per_s", "skipped", "ratio_mean",
            # PPO: the value loss (either critic) and a separate critic's own step.
            "value_loss", "value_mean", "value_clip_frac", "critic_grad_norm", "critic_lr",
            "critic_step_time_s")


class TrainerLoop:
    def __init__(self, config: TrainerConfig, consumer: Any, store: Any, js: Any, worker: Worker) -> None:
        self.config = config
        self.consumer = consumer
        self.store = store
        self.worker = worker
        self.learner = Learner(config, worker)
        self.checkpointer = Checkpointer(config.checkpoint_dir(), config.checkpoint.keep)
        self.publisher = VersionPublisher(store, js, config.run_id, worker, sender=_sender(config))
        self.metrics = TrainerMetrics()
        self.ledger = TrainedLedger()
        self.filters = GroupFilters(config.group_filter, config.max_staleness,
                                    group_relative=config.loss.algorithm != "ppo")
        self.intake = Intake(consumer, Limits(config.run_id, 0, 0), self.ledger,
                             GroupBuffer(config.group_size, config.group_filter.timeout_s), self.filters,
                             version=lambda: self.version,
                             capacity=config.groups_per_step + config.prefetch_groups,
                             heartbeat_s=config.consumer.ack_wait_s / 3, on_drop=self._dropped)
        self.busy = asyncio.Lock()
        self.version = 0
        self.parent_version = -1
        self.next_version = 1
        self.lora_base: int | None = None  # LoRA: the full version every adapter version applies to
        self.state = "starting"
        self.state_message = "loading the model"
        self.last_metrics: dict[str, float] = {}
        self.last_checkpoint = ""
        self._started = 0.0
        self._busy_s = 0.0

    # ------------------------------------------------------------ the loop

    async def run(self) -> None:
        await self.restore()
        async with self._background(self.intake.run(), self.intake.keep_alive(), self.learner.keep_alive()):
            while True:
                groups = await self._wait_for(self.config.groups_per_step)   # consume → group → filter
                async with self._busy():
                    if self.intake.paused:                                    # paused while we waited
                        await self.intake.requeue(groups)
                        continue
                    samples = await self.fresh(groups)                        # staleness at this version
                    if not samples:
                        continue
                    with step_span(samples, self.learner.step + 1) as span:   # linked to each episode
                        metrics = await self.learner.train([c.sample for c in samples])   # batch → step
                        self.record(samples, metrics)
                        span.set_attribute("rlfleet.policy_version", self.version)
                    if len(self.ledger.uncommitted) >= self.config.checkpoint.every:
                        await self.checkpoint()                               # durable, then ack
                    await self.publish(metrics)                               # v+1: store, then POLICY

    async def restore(self) -> None:
        """The latest checkpoint (weights, optimizer, ledger, version) or the starting model; then
        makes sure the store and POLICY have the version the trainer holds."""
        await self.learner.load()
        startup.mark("model_built")
        vocab, max_tokens = model_limits(self.config.model_path)
        self.intake.limits = Limits(self.config.run_id, vocab, max_tokens)
        self.checkpointer.remove_temporaries()
        restored = self.checkpointer.latest()
        if restored is not None:
            await self.learner.load_checkpoint(restored.path)
            startup.mark("checkpoint_loaded")
            self.ledger = self.intake.ledger = restored.ledger
            self.version, self.parent_version = restored.state.policy_version, restored.state.parent_version
            self.intake.dropped_by_reason.update(restored.state.dropped_by_reason)
            self.last_checkpoint = str(restored.path)
            log.info("restored checkpoint %s: step %d, version %d, %d trajectories trained", restored.path,
                     self.learner.step, self.version, self.ledger.trained_count)
        await self._sync_versions()
        self.metrics.version.set(self.version)
        self.state, self.state_message = "running", ""
        self._started = time.monotonic()
        startup.mark("ready")

    async def _sync_versions(self) -> None:
        latest = self.store.latest_version()
        if self.config.lora.enabled:
            self.lora_base = await self.worker.call(self._find_lora_base, latest)
        if latest is None or latest < self.version:
            # First start (version 0, the starting model), or a checkpoint whose version
            # never reached the store.
            await self._publish_version(-1 if latest is None else self.parent_version, {})
        elif latest == self.version:
            announced = await self.publisher.last_announced()
            if announced is None or announced < latest:
                await self.publisher.announce(self.store.manifest(latest), self.parent_version,
                                              self.learner.step, {})
        else:
            log.warning("versions %d..%d were published after the last checkpoint and are abandoned; "
                        "continuing from version %d", self.version + 1, latest, self.version)
        self.next_version = max(latest if latest is not None else -1, self.version) + 1

    async def fresh(self, groups: list[ReadyGroup]) -> list[Candidate]:
        """The groups' members that are still fresh enough at the trainer's current version."""
        samples = []
        for group in groups:
            screened = self.filters.screen_members(group.members, self.version)
            await self.intake.drop(screened.dropped)
            samples += screened.kept
        return samples

    def record(self, samples: list[Candidate], metrics: dict[str, float]) -> None:
        staleness = [self.filters.staleness.of(c, self.version) for c in samples]
        self.parent_version, self.version = self.version, self.next_version
        self.next_version += 1
        self.ledger.record(self.learner.step, self.version, [c.trajectory_id for c in samples])
        self.last_metrics = {k: float(metrics[k]) for k in REPORTED if k in metrics}
        self.last_metrics.update(staleness_mean=sum(staleness) / len(staleness), staleness_max=max(staleness),
                                 samples=len(samples), groups=len({c.group_id for c in samples}))
        self.metrics.step(metrics, staleness, len(samples))
        self.metrics.version.set(self.version)
        log.info("step %d -> version %d: %d samples, loss %.4f", self.learner.step,
                 self.version, len(samples), self.last_metrics.get("loss", float("nan")),
                 extra={"step": self.learner.step, "version": self.version,
                        **{k: round(v, 6) for k, v in self.last_metrics.items()}})

    async def checkpoint(self) -> Path:
        """Writes a checkpoint of the current state; once it is durable, acks what it includes."""
        start = time.monotonic()
        state = ServiceState(self.config.run_id, self.learner.step, self.version, self.parent_version,
                             self.ledger.trained_count, dict(self.intake.dropped_by_reason))
        path = await self.worker.call(self.checkpointer.save, state, self.ledger.records(),
                                      self.learner.save_checkpoint)
        await self.intake.settle(self.ledger.commit())
        self.last_checkpoint = str(path)
        self.metrics.checkpoint_time.record(time.monotonic() - start)
        return path

    async def publish(self, metrics: dict[str, float]) -> None:
        start = time.monotonic()
        await self._publish_version(self.parent_version, self.last_metrics)
        self.metrics.publish_time.record(time.monotonic() - start)
        startup.mark("first_version_published")

    async def _publish_version(self, parent: int, metrics: dict[str, float]) -> None:
        """The current version to the store and POLICY: the full policy, or with LoRA the adapter on the
        base version (the base itself, in full, when the store has none yet)."""
        if not self.config.lora.enabled:
            shards = self.learner.send_p2p_shards if self.learner.sends_own_shards else None
            await self.publisher.publish(self.version, parent, self.learner.export,
                                         self.learner.step, metrics, shards=shards)
        elif self.lora_base is None:
            await self.publisher.publish(self.version, parent, self.learner.export_base,
                                         self.learner.step, metrics)
            self.lora_base = self.version
        else:
            await self.publisher.publish_adapter(self.version, parent, self.lora_base,
                                                 self.learner.export_adapter, self.learner.step, metrics)

    def _find_lora_base(self, latest: int | None) -> int | None:
        """LoRA: the base version of this run's adapters (the newest full version up to the trainer's),
        or None when the store has none yet. A trained adapter with no base in the store cannot be
        published on anything: that is refused rather than guessed."""
        for version in reversed(self.store.list_versions()):
            if version > self.version:
                continue
            index = self.store.index(version)
            return version if index.kind == "full" else index.base_version
        if self.version > 0:
            raise RuntimeError(f"the checkpoint is at version {self.version} but the weight store has no "
                               "base version for its LoRA adapter: restore the store, or "
                               "start the run afresh")
        return None

    # ------------------------------------------------------------ control (gRPC)

    async def pause(self) -> None:
        """Stops consuming; returns once a step in progress (with its checkpoint and publish) is done."""
        await self.intake.pause()
        async with self.busy:
            pass

    async def resume(self) -> None:
        await self.intake.resume()

    async def checkpoint_now(self) -> Path:
        async with self._busy():
            return await self.checkpoint()

    async def shutdown(self, run: asyncio.Task) -> None:
        """Stops consuming, lets a step in progress finish, checkpoints what no checkpoint has yet,
        stops `run` (never inside a step) and hands the other held messages back for redelivery."""
        await self.intake.pause()
        async with self.busy:
            if self.ledger.uncommitted and self.config.checkpoint.on_stop:
                path = await self.checkpoint()
                log.info("checkpoint on stop", extra={"path": str(path)})
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
        await self.intake.release()

    # ------------------------------------------------------------ status

    @property
    def idle_fraction(self) -> float:
        if not self._started:
            return 0.0
        active = time.monotonic() - self._started - self.intake.paused_s
        return max(active - self._busy_s, 0.0) / active if active > 0 else 0.0

    def describe(self) -> tuple[str, str]:
        if self.state in ("starting", "failed"):
            return self.state, self.state_message
        if self.intake.paused:
            return "paused", "consuming is paused (Resume to continue)"
        if self.busy.locked():
            return "training", f"step {self.learner.step + 1}"
        need = self.config.groups_per_step
        return "waiting_for_data", (f"waiting for {need} complete groups: {len(self.intake.ready)} ready, "
                                    f"{len(self.intake.buffer)} incomplete")

    def _dropped(self, reason: str, n: int) -> None:
        self.metrics.dropped.add(n, {"reason": reason})

    async def _wait_for(self, n: int) -> list[ReadyGroup]:
        start, paused = time.monotonic(), self.intake.paused_s
        groups = await self.intake.take(n)
        self.metrics.wait.add(max(time.monotonic() - start - (self.intake.paused_s - paused), 0.0))
        self.metrics.idle.set(self.idle_fraction)
        self.metrics.pending_groups.set(len(self.intake.buffer))
        return groups

    @asynccontextmanager
    async def _busy(self):
        async with self.busy:
            start = time.monotonic()
            try:
                yield
            finally:
                self._busy_s += time.monotonic() - start

    @asynccontextmanager
    async def _background(self, *coroutines):
        """Runs helper tasks beside the loop; one that fails fails the loop (it is never left dead)."""
        main = asyncio.current_task()
        assert main is not None  # the loop runs as a task
        failures: list[BaseException] = []

        def check(task: asyncio.Task) -> None:
            failure = None if task.cancelled() else task.exception()
            if failure is not None:
                failures.append(failure)
                main.cancel()

        tasks = [asyncio.create_task(c) for c in coroutines]
        for t in tasks:
            t.add_done_callback(check)
        try:
            yield
        except asyncio.CancelledError:
            if failures:
                raise failures[0] from None
            raise
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _sender(config: TrainerConfig):
    if not config.weight_send.broker_address:
        return None
    from rlfleet.trainer.weight_sender import WeightSender

    return WeightSender(config.weight_send)


def step_span(samples: list[Candidate], step: int):
    """The span of one optimizer step, linked to the trace of every episode it trains on (a step
    is not part of any one episode's trace: it consumes many). The SDK keeps the first 128 links."""
    links = [link for c in samples
             if (link := link_to(c.trace_context, {"rlfleet.trajectory_id": c.trajectory_id})) is not None]
    return tracer.start_as_current_span("trainer step", links=links,
                                        attributes={"rlfleet.step": step, "rlfleet.samples": len(samples)})
