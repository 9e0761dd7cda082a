"""The trainer service under a steady trajectory stream: trained tokens/s and the share of time it
waits for data, at several offered rates. Prints figures; it is not a pass/fail test.

    .venv/bin/python bench/trainer_idle.py                       # rates 8, 16, 32, 64 trajectories/s
    .venv/bin/python bench/trainer_idle.py --rates 20,40 --phase-s 20

One `rlfleet-trainer` process (real NATS JetStream, weight store, a checkpoint every step) consumes
what a publisher task puts on TRAJECTORIES at a fixed rate, phase after phase. Figures per phase
come from the trainer's own Prometheus counters (trained tokens, data-wait seconds) over the phase,
after a warm-up. Model: Qwen2, hidden 128, 2 layers, vocab 320; trajectories of 96-160 tokens in
groups of 8, 4 groups per step, 1 torch thread; the publisher shares the machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

G, GROUPS_PER_STEP = 8, 4
COUNTERS = ("rlfleet_trainer_trained_tokens_total", "rlfleet_trainer_trained_trajectories_total",
            "rlfleet_trainer_data_wait_seconds_total", "rlfleet_trainer_steps_total",
            "rlfleet_trainer_step_duration_seconds_sum", "rlfleet_trainer_checkpoint_duration_seconds_sum",
            "rlfleet_trainer_publish_duration_seconds_sum")


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for name in COUNTERS:
        m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
        out[name] = float(m.group(1)) if m else 0.0
    return out


async def publisher(js, run_id: str, rate: float, stop: asyncio.Event, first_group: int) -> int:
    """Publishes groups' trajectories one at a time at `rate` per second, stopping after a whole
    step's worth of groups; returns the groups published."""
    from rlfleet.trainer.testing import publish_trajectories, trajectory_protos

    interval, group = 1.0 / rate, first_group
    next_at = time.monotonic()
    while not stop.is_set() or (group - first_group) % GROUPS_PER_STEP:
        for traj in trajectory_protos(1, G, run_id, lengths=(96, 160), seed=group, prefix=f"g{group}-"):
            await publish_trajectories(js, run_id, [traj])
            next_at += interval
            await asyncio.sleep(max(next_at - time.monotonic(), 0.0))
        group += 1
    return group - first_group


async def bench(rates: list[float], phase_s: float, warmup_s: float, workdir: Path) -> None:
    from rlfleet.common.config import NatsConfig
    from rlfleet.common.processes import start_nats
    from rlfleet.common.streams import connect_nats, ensure_streams
    from rlfleet.trainer.testing import TrainerProcess, write_tiny_model

    nats = start_nats(workdir / "nats")
    url = nats.url
    trainer = None
    try:
        model = write_tiny_model(workdir / "model", hidden_size=128)
        nc = await connect_nats(NatsConfig(url=url), "bench")
        js = nc.jetstream()
        await ensure_streams(js)
        trainer = TrainerProcess(workdir, url, "bench", model, "--group-size", str(G), "--groups-per-step",
                                 str(GROUPS_PER_STEP), "--max-staleness", "100000", "--log.level", "WARNING",
                                 "--optim.lr", "1e-5").start()
        trainer.wait_for(lambda s: s.state == "waiting_for_data", what="a ready trainer")
        port = trainer.info["metrics_port"]
        print(f"{'offered traj/s':>14} {'trained traj/s':>14} {'trained tokens/s':>16} {'idle':>6} "
              f"{'steps':>6} {'step ms':>8} {'ckpt ms':>8} {'publish ms':>10}")
        group = 0
        for rate in rates:
            stop = asyncio.Event()
            task = asyncio.create_task(publisher(js, "bench", rate, stop, group))
            await asyncio.sleep(warmup_s)
            before, t0 = scrape(port), time.monotonic()
            await asyncio.sleep(phase_s)
            after, wall = scrape(port), time.monotonic() - t0
            stop.set()
            group += await task
            d = {k: after[k] - before[k] for k in COUNTERS}
            steps = max(d[COUNTERS[3]], 1.0)
            print(f"{rate:14.1f} {d[COUNTERS[1]] / wall:14.1f} {d[COUNTERS[0]] / wall:16.0f} "
                  f"{min(d[COUNTERS[2]] / wall, 1.0):6.2f} {d[COUNTERS[3]]:6.0f} "
                  f"{1000 * d[COUNTERS[4]] / steps:8.0f} {1000 * d[COUNTERS[5]] / steps:8.0f} "
                  f"{1000 * d[COUNTERS[6]] / steps:10.0f}", flush=True)
            # Let the trainer drain what is left before the next phase.
            trainer.wait_for(lambda s: s.queue_depth == 0, timeout_s=120, what="a drained queue")
        status = trainer.status()
        print(f"total: {status.step} steps, {status.trained_trajectories} trajectories, "
              f"dropped {dict(status.dropped_by_reason) or 'none'}, "
              f"idle fraction since start {status.idle_fraction:.2f}")
        await nc.close()
    finally:
        if trainer is not None:
            trainer.stop()
        nats.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="8,16,32,64",
                        help="offered trajectories/s per phase, comma-separated")
    parser.add_argument("--phase-s", type=float, default=15.0, help="measured seconds per phase")
    parser.add_argument("--warmup-s", type=float, default=3.0,
                        help="unmeasured seconds at the start of a phase")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="trainer-idle-"))
    try:
        asyncio.run(bench([float(r) for r in args.rates.split(",")], args.phase_s, args.warmup_s, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
