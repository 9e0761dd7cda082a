"""CPU per episode spent outside the model, by process: what the service hops cost an episode.

    .venv/bin/python bench/episode_cpu.py [--concurrency 16] [--episodes 256] [--group-size 8]
                                          [--repeats 3] [--warmup 64] [--json OUT]

Launches the rollout platform with `rlfleet up --detach` in a temporary run directory (gateway,
session server, verifier, sandbox manager, NATS, Redis) in front of the scripted engine
(rlfleet.envkit.testing: a tool call, then the answer; it stands in for the model, so what is left
is the service path), and runs calc episodes through an in-process `RolloutWorker` with the calc
tool in the worker (`tool_runtime = "in_process"`, the loop's default): admission, OpenSession,
two Generates (the observation rides with the second), Verify, CloseSession (the trajectory is
published on JetStream).

For each repeat it reads every process's CPU seconds (user + system, all threads, from /proc via
psutil) before and after `--episodes` episodes and prints the CPU milliseconds per episode of each:
the services, NATS, Redis, the worker (this process: the agent loop, its gRPC clients, the task
queue) and the engine (the model's stand-in, left out of the total). CPU seconds, not wall time,
because they hold on a machine other work shares: the median over the repeats is printed.
`--profile DIR` also records each Python process with py-spy during the first repeat (collapsed
stacks; py-spy is not a dependency: `.venv/bin/pip install py-spy -c requirements/lock.txt`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

MODEL = "engine"  # the process that stands in for the model: reported, not counted as service path


def cpu_seconds(process) -> float:
    times = process.cpu_times()
    return times.user + times.system


async def run_level(info, concurrency: int, episodes: int, group_size: int, seed: int, processes: dict):
    import psutil

    from rlfleet.envkit.submit import publish_tasks, write_for_verifier
    from rlfleet.envkit.suites import calc
    from rlfleet.envkit.worker import RolloutWorker
    from rlfleet.envkit.worker_config import WorkerConfig

    n_tasks = max(1, episodes // group_size)
    tasks = calc.generate_tasks("train", n_tasks, seed=seed)
    write_for_verifier(tasks, info.suites_dir)
    await publish_tasks(tasks, info.run_id, info.nats_url, group_size, epoch=seed, temperature=1.0,
                        login=info.nats_login("operator"))
    config = WorkerConfig(run_id=info.run_id, nats={"url": info.nats_url, **info.nats_login("worker")},
                          session_address=info.session_address, sandbox_address=info.sandbox_address,
                          verifier_address=info.verifier_address, concurrency=concurrency,
                          episode_timeout_s=120, tool_runtime="in_process")
    me = psutil.Process()
    before = {name: cpu_seconds(p) for name, p in processes.items()}
    before["worker"] = cpu_seconds(me)
    started = time.perf_counter()
    stats = await RolloutWorker(config).run_until(n_tasks)
    elapsed = time.perf_counter() - started
    after = {name: cpu_seconds(p) for name, p in processes.items()}
    after["worker"] = cpu_seconds(me)
    done = list(stats.recent)
    n = len(done)
    return {"episodes": n, "seconds": elapsed, "eps": n / elapsed,
            "turns": statistics.mean(s.turns for s in done),
            "tool_calls": statistics.mean(s.tool_calls for s in done),
            "passed": sum(s.passed for s in done), "outcomes": dict(stats.episodes),
            "cpu_ms": {name: (after[name] - before[name]) * 1000 / n for name in after}}


def start_profilers(directory: Path, processes: dict) -> list:
    """`py-spy record` on each Python process (and on this one, the worker), collapsed stacks per file."""
    import os
    import subprocess

    directory.mkdir(parents=True, exist_ok=True)
    targets = {name: p.pid for name, p in processes.items() if name not in ("nats", "redis")}
    targets["worker"] = os.getpid()
    spy = str(Path(sys.executable).parent / "py-spy")
    return [subprocess.Popen([spy, "record", "--nonblocking", "-r", "250", "-f", "raw", "-o",
                              str(directory / f"{name}.txt"), "--pid", str(pid)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, pid in targets.items()]


def stop_profilers(spies: list) -> None:
    import signal

    for spy in spies:
        spy.send_signal(signal.SIGINT)
    for spy in spies:
        spy.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--episodes", type=int, default=256,
                        help="episodes per repeat (rounded to whole groups)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=64, help="episodes run first, not measured")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--profile", type=Path, default=None,
                        help="py-spy every process but NATS and Redis during the first "
                             "repeat; collapsed stacks here")
    args = parser.parse_args()

    import psutil

    from rlfleet.common.testing import unique_run_id
    from rlfleet.envkit.testing import LaunchedPlatform, build_tokenizer, start_scripted_engine

    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-") as tmp:
        model = build_tokenizer(Path(tmp) / "tokenizer")
        engine, url = start_scripted_engine(model, Path(tmp))
        platform = LaunchedPlatform(Path(tmp) / "run", unique_run_id("bench"), model, engine_url=url)
        try:
            platform.up()
            state = json.loads((platform.run_dir / "platform.json").read_text())
            processes = {p["name"]: psutil.Process(p["pid"]) for p in state["processes"] if p.get("pid")}
            processes[MODEL] = psutil.Process(engine.pid)
            print(f"processes: {', '.join(sorted(processes))}; concurrency {args.concurrency}, group size "
                  f"{args.group_size}, {args.episodes} episodes x {args.repeats} repeats; "
                  f"{psutil.cpu_count()} cpus, load {psutil.getloadavg()[0]:.1f}", flush=True)
            asyncio.run(run_level(platform.info, args.concurrency, args.warmup, args.group_size,
                                  999, processes))
            runs = []
            for repeat in range(args.repeats):
                spies = start_profilers(args.profile, processes) if repeat == 0 and args.profile else []
                r = asyncio.run(run_level(platform.info, args.concurrency, args.episodes, args.group_size,
                                          1000 + repeat, processes))
                stop_profilers(spies)
                runs.append(r)
                outside = sum(v for k, v in r["cpu_ms"].items() if k != MODEL)
                print(f"repeat {repeat}: {r['episodes']} episodes in {r['seconds']:.1f}s ({r['eps']:.1f}/s), "
                      f"turns/ep {r['turns']:.2f}, "
                      f"tool calls/ep {r['tool_calls']:.2f}, passed {r['passed']}, "
                      f"{r['outcomes']}; CPU ms/episode outside the model {outside:.2f}  "
                      + "  ".join(f"{k} {v:.2f}" for k, v in sorted(r["cpu_ms"].items())), flush=True)
        finally:
            platform.down()
            engine.stop()
    names = sorted(runs[0]["cpu_ms"])
    median = {name: statistics.median(r["cpu_ms"][name] for r in runs) for name in names}
    outside = statistics.median(sum(v for k, v in r["cpu_ms"].items() if k != MODEL) for r in runs)
    print("\nCPU ms per episode (median of repeats), by process:")
    for name in sorted(names, key=lambda n: -median[n]):
        print(f"  {name:<18} {median[name]:7.2f}"
              + ("   (the model's stand-in, not counted)" if name == MODEL else ""))
    print(f"  {'outside the model':<18} {outside:7.2f}   (load average {psutil.getloadavg()[0]:.1f})")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
                                         "median_cpu_ms": median, "outside_model_ms": outside}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
