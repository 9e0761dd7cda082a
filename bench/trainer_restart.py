"""Where a SIGKILLed trainer's time goes until it trains again. Prints figures; not a pass/fail test.

    .venv/bin/python bench/trainer_restart.py                    # 3 kills, the default ack_wait
    .venv/bin/python bench/trainer_restart.py --kills 2 --ack-wait-s 6
    .venv/bin/python bench/trainer_restart.py --importtime       # also the startup path's slowest imports
    .venv/bin/python bench/trainer_restart.py --standby          # a standby promoted, not a cold start

One `rlfleet-trainer` process (real NATS JetStream, weight store, a checkpoint every step; Qwen2,
hidden 128, 2 layers, vocab 320; groups of 4, 2 groups a step, 1 torch thread) trains two steps,
then is handed one more group, which it holds unacked (a step needs two). Then, per kill: SIGKILL,
one more group published (post-kill data), the trainer started again in the same directory (its
checkpoint present). The phases come from the restarted trainer's own `startup phase` log lines
(rlfleet.trainer.startup), on CLOCK_MONOTONIC like this script's, so each is shown as seconds after
the kill; "serving" is when its ready file appeared. With --standby the restart is what the
launcher does (rlfleet.common.standby): a `--standby` trainer started beside the live one, its
imports done before the kill, is promoted with SIGUSR1 ("spawn" is then the promotion, "entry"
the moment it took it). "first_redelivery" is when the first of the
held messages came back (ack_wait after the dead trainer's last in-progress ack); the version after
the kill needs the held group, so it is trained after both the restart and the redelivery.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

G, GROUPS_PER_STEP = 4, 2
PHASES = ("config_and_service_imports", "peers_connected", "training_imports", "consumer_attached", "serving",
          "model_built", "checkpoint_loaded", "ready", "first_delivery", "first_redelivery",
          "first_version_published")
STARTUP_MODULES = ("rlfleet.trainer.main, rlfleet.trainer.app, rlfleet.trainer.loop, "
                   "rlfleet.trainer.torch_backend")


def startup_marks(log_path: Path, offset: int) -> tuple[dict[str, float], float | None]:
    """{phase: perf_counter} and the entry's perf_counter, from the log written after `offset`."""
    marks, entry = {}, None
    with log_path.open("rb") as f:
        f.seek(offset)
        for line in f.read().decode(errors="replace").splitlines():
            if '"phase"' not in line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "phase" in record and "perf_counter" in record:
                marks[record["phase"]] = record["perf_counter"]
                entry = record["entry_perf_counter"]
    return marks, entry


async def held_count(js, consumer: str) -> int:
    info = await js.consumer_info("TRAJECTORIES", consumer)
    return int(info.num_ack_pending or 0)


async def wait(predicate, timeout_s: float, what: str, interval_s: float = 0.02):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(interval_s)
    raise TimeoutError(f"no {what} within {timeout_s:.0f} s")


def print_importtime(top: int) -> None:
    """`python -X importtime` of the modules the trainer imports before it trains: the slowest by
    cumulative time (a package's time includes its submodules')."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {STARTUP_MODULES}"],
                          capture_output=True, text=True, check=True)
    rows = []
    for line in proc.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if m:
            rows.append((int(m.group(2)), len(m.group(3)) // 2, m.group(4)))
    total = sum(cum for cum, depth, _ in rows if depth == 0)
    print(f"\nimports of {STARTUP_MODULES}: {total / 1e6:.2f} s in all; the slowest at any depth "
          "(cumulative, so nested ones overlap):")
    for cum, depth, name in sorted(rows, reverse=True)[:top]:
        print(f"  {cum / 1e6:7.3f} s  {'  ' * depth}{name}")


async def bench(kills: int, ack_wait_s: float | None, workdir: Path, standby: bool) -> None:
    from rlfleet.common.config import NatsConfig
    from rlfleet.common.processes import start_nats
    from rlfleet.common.standby import PROMOTE
    from rlfleet.common.streams import connect_nats, ensure_streams
    from rlfleet.trainer.testing import (
        TrainerProcess,
        publish_trajectories,
        trajectory_protos,
        write_tiny_model,
    )

    nats = start_nats(workdir / "nats")
    trainer = None
    run = "restart"
    try:
        model = write_tiny_model(workdir / "model", hidden_size=128)
        nc = await connect_nats(NatsConfig(url=nats.url), "bench")
        js = nc.jetstream()
        await ensure_streams(js)

        async def publish_group(name: str) -> None:
            await publish_trajectories(js, run, trajectory_protos(1, G, run, lengths=(96, 160),
                                                                  seed=len(name), prefix=f"{name}-"))

        args = ["--group-size", str(G), "--groups-per-step", str(GROUPS_PER_STEP),
                "--max-staleness", "100000",
                "--checkpoint.every", "1", "--optim.lr", "1e-5", "--log.format", "json"]
        if ack_wait_s is not None:
            args += ["--consumer.ack-wait-s", str(ack_wait_s)]
        for k in range(2 * GROUPS_PER_STEP):
            await publish_group(f"warm{k}")
        trainer = TrainerProcess(workdir, nats.url, run, model, *args).start(timeout_s=300)
        trainer.wait_for(lambda s: s.trained_trajectories == 2 * GROUPS_PER_STEP * G and s.last_checkpoint,
                         timeout_s=300, what="two steps checkpointed")
        consumer = f"trainer-{run}"
        rows = []
        for kill in range(kills):
            spare = await asyncio.to_thread(trainer.standby) if standby else None
            await publish_group(f"held{kill}")
            await wait(lambda: _equals(held_count(js, consumer), G), 60, "held group")
            await asyncio.sleep(0.5)  # past the fetch: the trainer holds the group, as a live one would
            killed_at = time.perf_counter()
            trainer.kill()
            await publish_group(f"after{kill}")
            offset = trainer.log_path.stat().st_size
            spawned_at = time.perf_counter()
            if spare is None:
                trainer.spawn()
            else:
                spare.process.send_signal(PROMOTE)
                trainer = spare
            serving_at = await wait(lambda path=trainer.ready_file: _exists_at(path), 300, "ready file")
            marks = await wait(lambda at=offset, path=trainer.log_path:
                               _marks_with(path, at, "first_version_published"), 300,
                               "version after the kill", interval_s=0.1)
            phases, entry = marks
            phases["serving"] = serving_at
            rows.append((killed_at, spawned_at, entry, phases))
            trainer.wait_ready(30)
        _print(rows, ack_wait_s, standby)
        await nc.close()
    finally:
        if trainer is not None:
            trainer.stop()
        nats.stop()


async def _equals(awaitable, value):
    return (await awaitable) == value


async def _exists_at(path: Path) -> float | None:
    return time.perf_counter() if await asyncio.to_thread(path.exists) else None


async def _marks_with(log_path: Path, offset: int, phase: str):
    marks, entry = startup_marks(log_path, offset)
    return (marks, entry) if phase in marks else None


def _print(rows, ack_wait_s: float | None, standby: bool) -> None:
    print(f"\n{'a standby promoted' if standby else 'a cold start'}; "
          f"ack_wait_s: {ack_wait_s if ack_wait_s is not None else 'default'}; seconds after the SIGKILL "
          f"(phase: step from the previous one), {len(rows)} kills")
    header = ["spawn", "entry", *PHASES]
    print(f"{'phase':>28} " + " ".join(f"{f'kill {i + 1}':>14}" for i in range(len(rows))))
    for name in header:
        cells = []
        for killed_at, spawned_at, entry, phases in rows:
            at = {"spawn": spawned_at, "entry": entry, **phases}
            order = sorted((v, n) for n, v in at.items() if v is not None and n != "first_redelivery")
            t = at.get(name)
            if t is None:
                cells.append(f"{'-':>14}")
                continue
            previous = max((v for v, n in order if v < t and n != name), default=killed_at)
            cells.append(f"{t - killed_at:6.2f} ({t - previous:+5.2f})")
        print(f"{name:>28} " + " ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--ack-wait-s", type=float, default=None,
                        help="the trainer's; default: its own default")
    parser.add_argument("--standby", action="store_true",
                        help="promote a standby trainer instead of a cold start")
    parser.add_argument("--importtime", action="store_true",
                        help="also print the startup path's slowest imports")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="rlfleet-trainer-restart-"))
    try:
        asyncio.run(bench(args.kills, args.ack_wait_s, workdir, args.standby))
        if args.importtime:
            print_importtime(15)
    finally:
        if args.keep:
            print(f"work directory: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
