"""What the loop watches without steering anything: the engines' weight-update pauses, the trainer's
time waiting for data, and the progress line printed every 5 s."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc

from rlfleet.api.broker.v1 import broker_pb2, broker_pb2_grpc
from rlfleet.api.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from rlfleet.cli.loop_parts import Observer
from rlfleet.cli.run_context import LoopContext, rpc


class LoopWatch:
    def __init__(self, ctx: LoopContext, broker: broker_pb2_grpc.BrokerServiceStub,
                 trainer: trainer_pb2_grpc.TrainerServiceStub, trainer_metrics_url: str) -> None:
        self.ctx = ctx
        self.broker = broker
        self.trainer = trainer
        self.trainer_metrics_url = trainer_metrics_url
        self._trainer_mark: tuple[float, float] | None = None  # (data-wait counter, loop time) last read

    async def pauses(self) -> None:
        """Records each engine's last weight-update pause as its update count grows."""
        updates: dict[str, int] = {}
        while not self.ctx.stop.is_set():
            try:
                status = await rpc(self.broker.GetStatus, broker_pb2.GetStatusRequest())
            except Exception:  # the broker restarting: try again next round
                await asyncio.sleep(1.0)
                continue
            for engine in status.engines:
                if engine.updates > updates.get(engine.engine_id, 0):
                    updates[engine.engine_id] = engine.updates
                    self.ctx.record.weight_pauses_s.append(engine.last_pause_s)
            await asyncio.sleep(0.5)

    def restart_trainer_clock(self) -> None:
        """The next reading only marks where the account starts (the loop's time before it is not
        the trainer's idle time)."""
        self._trainer_mark = None

    async def trainer_idle(self) -> None:
        """Adds the trainer's data-wait time since the last reading to the loop's account (its own
        counter, so the baseline evaluation before the loop does not count as idle)."""
        ctx, record = self.ctx, self.ctx.record
        if not self.trainer_metrics_url:
            return
        try:
            text = await asyncio.to_thread(
                lambda: urllib.request.urlopen(self.trainer_metrics_url, timeout=3).read().decode())
        except OSError:
            return  # a trainer that is gone: its share of the loop is not measured
        ctx.trainer_dropped = trainer_dropped(text) or ctx.trainer_dropped
        waited = next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("rlfleet_trainer_data_wait_seconds_total")), None)
        if waited is None:
            return
        now = ctx.clock.elapsed()
        if self._trainer_mark is not None and waited >= self._trainer_mark[0]:
            record.trainer_wait_s += waited - self._trainer_mark[0]
            record.trainer_watched_s += now - self._trainer_mark[1]
            if record.trainer_watched_s > 0:
                # The counter grows when a wait ends, so a reading can hold waiting from before the
                # last one: over the whole loop the ratio is exact, between two readings it can pass 1.
                record.trainer_idle_fraction = min(1.0, record.trainer_wait_s / record.trainer_watched_s)
        self._trainer_mark = (waited, now)

    async def progress(self, observer: Observer) -> None:
        """A line every 5 s: step, version, reward, accepted held-out success, staleness, rate, pause,
        trainer idle."""
        ctx, record = self.ctx, self.ctx.record
        assert ctx.accepted_eval is not None  # the baseline, evaluated before the loop
        while not ctx.stop.is_set():
            await asyncio.sleep(5.0)
            try:
                status = await self.trainer.GetStatus(trainer_pb2.GetStatusRequest(), timeout=5)
            except grpc.aio.AioRpcError as exc:
                ctx.say(f"[{ctx.clock.elapsed():5.0f}s] the trainer is not answering ({exc.code().name}); "
                        f"see {ctx.run_dir / 'logs' / 'trainer.log'}")
                continue
            await self.trainer_idle()
            recent = [t for t in record.trajectories[-200:] if t.split == "train"]
            reward = sum(t.reward for t in recent) / len(recent) if recent else 0.0
            stale = max((t.staleness for t in recent), default=0)
            pauses = sorted(record.weight_pauses_s[-20:])
            pause = pauses[len(pauses) // 2] * 1000 if pauses else 0.0
            rate = observer.train_trajectories / max(ctx.clock.elapsed(), 1e-9)
            ctx.say(f"[{ctx.clock.elapsed():5.0f}s] step {status.step:3d}  v{status.policy_version:<3d} "
                    f"reward {reward:.2f}  held-out {ctx.accepted_eval.success:.2f} "
                    f"(accepted v{record.accepted_version})  "
                    f"staleness max {stale} (trained {status.last_metrics.get('staleness_mean', 0.0):.1f})  "
                    f"{rate:.1f} traj/s  pause p50 {pause:.0f} ms  "
                    f"trainer idle {record.trainer_idle_fraction:.0%}")


def trainer_dropped(metrics_text: str) -> dict[str, float]:
    """`rlfleet_trainer_dropped_trajectories_total` by its `reason` label, from a Prometheus text page."""
    found: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("rlfleet_trainer_dropped_trajectories_total{") and 'reason="' in line:
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            found[reason] = found.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return found
