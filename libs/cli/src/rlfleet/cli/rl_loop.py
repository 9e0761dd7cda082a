"""`rlfleet run CONFIG`: the asynchronous RL loop as one command.

    base policy  <- build the default model and SFT-warm-start it (cached)
    platform     <- NATS, Redis, engines (canary: rollouts + candidates; fleet: accepted versions), services
    baseline     <- evaluate the base policy on the held-out split and the regression set
    loop until the budget (steps or time):
        feeder keeps TASKS topped up | workers run groups of G episodes | the trainer steps on complete
        groups and announces versions | the broker ships them to the canary engines | admission keeps
        rollouts within the staleness bound | the gate evaluates candidates and promotes the good ones
    final        <- evaluate the accepted version; report (summary.json, plots, report.html)

`mode = "sync"` runs the same system in lock-step: one step's tasks, wait for the new version to be
served, repeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import grpc

from rlfleet.cli.gate import decide
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
from rlfleet.cli.report import GateDecision, RunRecord, StepRecord, write_report
from rlfleet.cli.run_config import RunConfig

log = logging.getLogger(__name__)


def say(text: str) -> None:
    print(text, flush=True)


class RLRun:
    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.run_dir = Path(config.run_dir or f"runs/{config.run_id}").resolve()
        self.clock = Clock()
        self.record = RunRecord(config.run_id, config.mode, config.model_dump(mode="json"), time.time())
        self.stop = asyncio.Event()
        self.accepted_eval = None
        self.accepted_regression = None
        self.last_gated = 0

    # -- the whole run ------------------------------------------------------------------------

    async def run(self) -> dict:
        base = await asyncio.to_thread(self._base_policy)
        platform = await asyncio.to_thread(self._platform_up, base)
        try:
            async with self._connections(platform.state) as peers:
                await self._loop(peers)
        finally:
            await asyncio.to_thread(platform.down)
        self.record.wall_s = self.record.wall_s or self.clock.elapsed()
        summary = write_report(self.record, self.run_dir)
        self._print_summary(summary)
        return summary

    def _base_policy(self) -> Path:
        from rlfleet.cli.warm_start import ensure_base_policy

        cache = Path(self.config.model_cache_dir).resolve() if self.config.model_cache_dir else self.run_dir.parent / ".cache"
        return ensure_base_policy(cache, self.config.model, self.config.warm_start, self.config.system_prompt, say)

    def _platform_up(self, base: Path):
        from rlfleet.cli.launcher import Platform
        from rlfleet.cli.platform_config import PlatformConfig

        c = self.config
        gate = c.gate.enabled
        overrides = {
            "trainer": {"group_size": c.group_size, "groups_per_step": c.trainer.groups_per_step,
                        "max_staleness": c.rollout.max_staleness, "torch_threads": c.trainer.torch_threads,
                        "loss": {"algorithm": c.trainer.loss}, "optim": {"lr": c.trainer.lr},
                        "backend": {"seed": c.seed}},
            # With a gate the canary moves every `every_versions` versions: the delta chain must reach
            # that far, or each move would be a full reload instead of a few deltas.
            "weight-broker": {"auto_promote": not gate,
                              "sync": {"every_n_versions": c.gate.every_versions if gate and c.mode == "async" else 1,
                                       "max_delta_chain": max(4, c.gate.every_versions)}},
            "rollout-gateway": {"max_inflight_sessions": c.rollout.max_inflight_sessions,
                                "route_pools": ["canary"]},
        }
        for name, extra in c.overrides.items():
            overrides.setdefault(name, {}).update(extra)
        say(f"platform: starting in {self.run_dir} ...")
        platform = Platform(PlatformConfig(run_id=c.run_id, run_dir=str(self.run_dir), engines=2, canary_engines=1,
                                           model_path=str(base), overrides=overrides, log_format="json"))
        platform.up()
        say("platform: healthy (" + ", ".join(p.name for p in platform.state.processes) + ")")
        return platform

    # -- connections ----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _connections(self, state):
        """NATS, the SDK's clients and stubs of the gateway, trainer and broker, closed on the way out."""
        from rlfleet.api.broker.v1 import broker_pb2_grpc
        from rlfleet.api.gateway.v1 import gateway_pb2_grpc
        from rlfleet.api.trainer.v1 import trainer_pb2_grpc
        from rlfleet.common.config import NatsConfig
        from rlfleet.common.grpc_server import channel
        from rlfleet.common.streams import connect_nats
        from rlfleet.envkit.sdk.clients import Clients

        channels = [channel(state.by_name(n).address) for n in ("rollout-gateway", "trainer", "weight-broker")]
        nc = await connect_nats(NatsConfig(url=state.by_name("nats").url), "rlfleet-run")
        clients = Clients.connect(session=state.by_name("session-server").address,
                                  sandbox=state.by_name("sandbox-manager").address,
                                  verifier=state.by_name("verifier").address)
        peers = SimpleNamespace(state=state, nc=nc, js=nc.jetstream(), clients=clients,
                                gateway=gateway_pb2_grpc.GatewayServiceStub(channels[0]),
                                trainer=trainer_pb2_grpc.TrainerServiceStub(channels[1]),
                                broker=broker_pb2_grpc.BrokerServiceStub(channels[2]))
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
        self.clock = Clock()
        self.record.started_unix = time.time()
        say(f"baseline: evaluating version 0 on {len(heldout)} held-out and {len(regression)} regression tasks ...")
        self.accepted_eval = await self._evaluate(peers, heldout, 0, "heldout", "baseline", "fleet")
        self.accepted_regression = await self._evaluate(peers, regression, 0, "regression", "baseline", "fleet") \
            if regression else None
        say(f"baseline: held-out success {self.accepted_eval.success:.3f}")
        observer = Observer(peers.js, c.run_id, self.record, self.clock)
        observer.version_listeners.append(lambda v: asyncio.ensure_future(self._admit_up_to(peers, v.version)))
        observer.version_listeners.append(lambda v: self.record.steps.append(StepRecord(
            step=int(v.step), version=int(v.version), elapsed_s=self.clock.elapsed(),
            reward_mean=float(v.metrics.get("reward_mean", 0.0)), metrics=dict(v.metrics))) if v.version > 0 else None)
        await observer.start()
        await self._admit_up_to(peers, 0)
        worker = self._worker(peers)
        feeder = Feeder(peers.js, c.run_id, task_messages(train, c.run_id, c.group_size, c.rollout.temperature,
                                                          c.system_prompt))
        say(f"loop: {c.mode}, G={c.group_size}, {c.trainer.groups_per_step} groups/step, "
            f"budget {c.budget.max_steps} steps or {c.budget.max_minutes:g} min")
        background = [asyncio.create_task(worker.run(self.stop)),
                      asyncio.create_task(CpuSampler([p.pid for p in peers.state.processes], self.record,
                                                     self.clock).run(self.stop)),
                      asyncio.create_task(self._watch_pauses(peers)),
                      asyncio.create_task(self._progress(peers, observer))]
        try:
            if c.mode == "async":
                in_flight = c.rollout.concurrency // c.group_size + c.rollout.backlog_groups
                background.append(asyncio.create_task(
                    feeder.keep_topped_up(lambda: observer.groups_done, in_flight, self.stop)))
                background.append(asyncio.create_task(self._gate_loop(peers, heldout, regression)))
                await self._until_budget(observer)
            else:
                await self._sync_steps(peers, feeder, observer, heldout, regression)
        finally:
            self.record.wall_s = self.clock.elapsed()
            self.stop.set()
            await asyncio.gather(*background, return_exceptions=True)
            await observer.stop()
        await self._finish(peers, heldout, regression)

    def _tasks(self, peers):
        from rlfleet.envkit.submit import write_for_verifier
        from rlfleet.envkit.suites import calc

        c = self.config
        train = calc.generate_tasks("train", 2000, seed=c.seed, difficulty=c.difficulty)
        heldout = calc.generate_tasks("heldout", c.eval.heldout, seed=c.seed, difficulty=c.difficulty)
        regression = calc.generate_tasks("regression", c.eval.regression, seed=c.seed, difficulty=c.difficulty) \
            if c.eval.regression else []
        write_for_verifier(train + heldout + regression, self.run_dir / "suites")
        as_messages = lambda tasks: task_messages(tasks, c.run_id, 1, c.eval.temperature, c.system_prompt)  # noqa: E731
        return train, as_messages(heldout), as_messages(regression)

    def _worker(self, peers):
        from rlfleet.envkit.sdk.environment import environment_for
        from rlfleet.envkit.worker import RolloutWorker
        from rlfleet.envkit.worker_config import WorkerConfig

        c, state = self.config, peers.state
        delay = latency_sampler(c.rollout.tool_latency, c.seed)
        environments = environment_for if c.rollout.tool_latency.distribution == "none" else \
            (lambda suite: SlowTools(environment_for(suite), delay))
        config = WorkerConfig(run_id=c.run_id, nats={"url": state.by_name("nats").url},
                              session_address=state.by_name("session-server").address,
                              sandbox_address=state.by_name("sandbox-manager").address,
                              verifier_address=state.by_name("verifier").address,
                              concurrency=c.rollout.concurrency, metrics={"enabled": False})
        return RolloutWorker(config, environments=environments, clients=peers.clients)

    async def _evaluate(self, peers, tasks, version: int, split: str, label: str, pool: str):
        result = await evaluate(peers.clients, tasks, version=version, split=split, label=label, pool=pool,
                                concurrency=self.config.eval.concurrency, clock=self.clock,
                                tag=f"{label}-v{version}-{split}-{time.monotonic_ns()}")
        self.record.evals.append(result)
        return result

    async def _admit_up_to(self, peers, trainer_version: int) -> None:
        from rlfleet.api.gateway.v1 import gateway_pb2

        await peers.gateway.SetAdmissionPolicy(gateway_pb2.AdmissionPolicy(
            max_inflight_sessions=self.config.rollout.max_inflight_sessions, trainer_version=trainer_version,
            max_staleness=self.config.rollout.max_staleness))

    async def _until_budget(self, observer) -> None:
        budget = self.config.budget
        while not self.stop.is_set():
            if observer.latest_version >= budget.max_steps or self.clock.elapsed() >= budget.max_minutes * 60:
                return
            await asyncio.sleep(0.5)

    async def _sync_steps(self, peers, feeder, observer, heldout, regression) -> None:
        c = self.config
        for step in range(c.budget.max_steps):
            if self.clock.elapsed() >= c.budget.max_minutes * 60 or self.stop.is_set():
                return
            await feeder.publish(c.trainer.groups_per_step)
            while observer.latest_version < step + 1 and not self.stop.is_set():  # noqa: ASYNC110 - a counter, not an event
                await asyncio.sleep(0.1)
            await self._wait_served(peers, step + 1, pool="canary")
            if c.gate.enabled and (step + 1) % c.gate.every_versions == 0:
                await self._gate(peers, step + 1, heldout, regression)

    async def _wait_served(self, peers, version: int, pool: str, timeout_s: float = 120.0) -> bool:
        from rlfleet.api.broker.v1 import broker_pb2

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.stop.is_set():
            status = await peers.broker.GetStatus(broker_pb2.GetStatusRequest())
            engines = [e for e in status.engines if e.pool == pool]
            if engines and all(e.policy_version >= version for e in engines):
                return True
            await asyncio.sleep(0.1)
        return False

    # -- the promotion gate ----------------------------------------------------------------------

    async def _gate_loop(self, peers, heldout, regression) -> None:
        from rlfleet.api.broker.v1 import broker_pb2

        if not self.config.gate.enabled:
            return
        while not self.stop.is_set():
            status = await peers.broker.GetStatus(broker_pb2.GetStatusRequest())
            canary = [e.policy_version for e in status.engines if e.pool == "canary"]
            version = min(canary) if canary else 0
            if version >= self.last_gated + self.config.gate.every_versions:
                await self._gate(peers, version, heldout, regression)
            await asyncio.sleep(1.0)

    async def _gate(self, peers, version: int, heldout, regression) -> None:
        from rlfleet.api.broker.v1 import broker_pb2

        self.last_gated = version
        candidate = await self._evaluate(peers, heldout, version, "heldout", "candidate", "canary")
        cand_reg = await self._evaluate(peers, regression, version, "regression", "candidate", "canary") \
            if regression else None
        decision = decide(self.config.gate, candidate, self.accepted_eval, cand_reg, self.accepted_regression)
        self.record.gate.append(GateDecision(version, decision.accepted, decision.reasons, self.clock.elapsed()))
        verdict = "accepted" if decision.accepted else "refused"
        say(f"gate: version {version} {verdict}: {'; '.join(decision.reasons)}")
        if decision.accepted:
            await peers.broker.Promote(broker_pb2.PromoteRequest(version=version, reason="; ".join(decision.reasons)))
            self.accepted_eval, self.accepted_regression = candidate, cand_reg
            self.record.accepted_version = version

    # -- watching and printing -------------------------------------------------------------------

    async def _watch_pauses(self, peers) -> None:
        from rlfleet.api.broker.v1 import broker_pb2

        updates: dict[str, int] = {}
        while not self.stop.is_set():
            try:
                status = await peers.broker.GetStatus(broker_pb2.GetStatusRequest())
            except Exception:  # the broker restarting: try again next round
                await asyncio.sleep(1.0)
                continue
            for engine in status.engines:
                if engine.updates > updates.get(engine.engine_id, 0):
                    updates[engine.engine_id] = engine.updates
                    self.record.weight_pauses_s.append(engine.last_pause_s)
            await asyncio.sleep(0.5)

    async def _progress(self, peers, observer) -> None:
        from rlfleet.api.trainer.v1 import trainer_pb2

        while not self.stop.is_set():
            await asyncio.sleep(5.0)
            try:
                status = await peers.trainer.GetStatus(trainer_pb2.GetStatusRequest(), timeout=5)
            except grpc.aio.AioRpcError as exc:
                say(f"[{self.clock.elapsed():5.0f}s] the trainer is not answering ({exc.code().name}); "
                    f"see {self.run_dir / 'logs' / 'trainer.log'}")
                continue
            self.record.trainer_idle_fraction = status.idle_fraction
            recent = [t for t in self.record.trajectories[-200:] if t.split == "train"]
            reward = sum(t.reward for t in recent) / len(recent) if recent else 0.0
            stale = max((t.staleness for t in recent), default=0)
            pauses = sorted(self.record.weight_pauses_s[-20:])
            pause = pauses[len(pauses) // 2] * 1000 if pauses else 0.0
            rate = observer.train_trajectories / max(self.clock.elapsed(), 1e-9)
            say(f"[{self.clock.elapsed():5.0f}s] step {status.step:3d}  v{status.policy_version:<3d} "
                f"reward {reward:.2f}  held-out {self.accepted_eval.success:.2f} (accepted v{self.record.accepted_version})  "
                f"staleness max {stale}  {rate:.1f} traj/s  pause p50 {pause:.0f} ms  idle {status.idle_fraction:.0%}")

    async def _finish(self, peers, heldout, regression) -> None:
        from rlfleet.api.trainer.v1 import trainer_pb2

        try:
            status = await peers.trainer.GetStatus(trainer_pb2.GetStatusRequest(), timeout=10)
            self.record.trainer_idle_fraction = status.idle_fraction
        except grpc.aio.AioRpcError as exc:
            self.record.notes.append(f"the trainer did not answer at the end: {exc.code().name}")
        if not self.config.gate.enabled and self.record.steps:
            self.record.accepted_version = max(s.version for s in self.record.steps)  # auto-promoted
        accepted = self.record.accepted_version
        if not await self._wait_served(peers, accepted, pool="fleet"):
            self.record.notes.append(f"the fleet did not serve version {accepted} in time for the final evaluation")
        say(f"final: evaluating the accepted version {accepted} on the held-out split ...")
        await self._evaluate(peers, heldout, accepted, "heldout", "final", "fleet")
        if regression:
            await self._evaluate(peers, regression, accepted, "regression", "final", "fleet")

    def _print_summary(self, summary: dict) -> None:
        rows = summary["baseline_vs_rl"]
        say("")
        say(f"run {summary['run_id']} ({summary['mode']}): {summary['steps']} steps in {summary['wall_s']:.0f} s, "
            f"accepted version {summary['accepted_version']}")
        for name, row in rows.items():
            say(f"  {name:12s} held-out success {row['task_success']:.3f}  invalid tool calls/ep "
                f"{row['invalid_tool_calls_per_episode']:.3f}  time {row['time_to_completion_s']:.2f} s  "
                f"turns {row['interactions_per_episode']:.2f}  safety {row['safety_violations_per_episode']:.3f}")
        say(f"report: {self.run_dir / 'report.html'}  summary: {self.run_dir / 'summary.json'}")


def main(argv: list[str]) -> int:
    from rlfleet.common.config import load_config

    if argv and not argv[0].startswith("-"):
        argv = ["--config", argv[0], *argv[1:]]
    config = load_config(RunConfig, argv, prog="rlfleet run")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    run = RLRun(config)

    async def go() -> dict:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, run.stop.set)
        return await run.run()

    import uvloop

    uvloop.run(go())
    return 0
