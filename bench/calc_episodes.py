"""calc episodes per second through the whole service path, at a few rollout-worker concurrencies.

    .venv/bin/python bench/calc_episodes.py [--concurrency 1 4 16] [--episodes 32] [--group-size 4]
                                            [--policy cpu|scripted] [--temperature 1.0]

Launches the platform with `rlfleet up --detach` in a temporary run directory (sandbox manager,
gateway, session server, verifier, and one CPU engine serving the default model, built once into
runs/.cache like the launcher does), submits calc train tasks as groups of G, and runs an in-process
`RolloutWorker` per level until its tasks are acked. Every episode takes the real path: admission,
session, Generate through the gateway to the engine, calculator exec in a bubblewrap sandbox,
AppendObservation, Verify, CloseSession (trajectory published on JetStream), DestroySandbox.

`--policy cpu` (default) is the untrained default model: most of its turns are not tool calls, so its
episodes are short; the per-level line reports turns and tool calls per episode so the figure can be
read. `--policy scripted` swaps the engine for the scripted ideal policy (rlfleet.envkit.testing:
a tool call, then the answer) to show the service path's own cost at two turns and one tool call.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def default_model(seed: int = 0) -> Path:
    """The launcher's default model, built once into runs/.cache and reused (as `rlfleet up` does)."""
    target = ROOT / "runs" / ".cache" / f"model-seed{seed}"
    if not (target / "model.safetensors").exists():
        building = target.with_name(target.name + ".bench.tmp")
        subprocess.run([str(BIN / "rlfleet-build-model"), "--out", str(building), "--seed", str(seed)],
                       check=True, stdout=subprocess.DEVNULL)
        building.rename(target)
    return target


async def run_level(info, concurrency: int, episodes: int, group_size: int, seed: int, temperature: float):
    from rlfleet.envkit.submit import publish_tasks, write_for_verifier
    from rlfleet.envkit.suites import calc
    from rlfleet.envkit.worker import RolloutWorker
    from rlfleet.envkit.worker_config import WorkerConfig

    n_tasks = max(1, episodes // group_size)
    tasks = calc.generate_tasks("train", n_tasks, seed=seed)
    write_for_verifier(tasks, info.suites_dir)
    await publish_tasks(tasks, info.run_id, info.nats_url, group_size, epoch=seed, temperature=temperature,
                        login=info.nats_login("operator"))
    config = WorkerConfig(run_id=info.run_id, nats={"url": info.nats_url, **info.nats_login("worker")},
                          session_address=info.session_address,
                          sandbox_address=info.sandbox_address, verifier_address=info.verifier_address,
                          concurrency=concurrency, episode_timeout_s=120)
    started = time.perf_counter()
    stats = await RolloutWorker(config).run_until(n_tasks)
    elapsed = time.perf_counter() - started
    done = list(stats.recent)
    return {
        "concurrency": concurrency, "episodes": len(done), "seconds": elapsed, "eps": len(done) / elapsed,
        "turns": statistics.mean(s.turns for s in done),
        "tool_calls": statistics.mean(s.tool_calls for s in done),
        "episode_p50": statistics.median(s.episode_s for s in done),
        "generate_share": sum(s.generate_s for s in done) / max(1e-9, sum(s.episode_s for s in done)),
        "tool_wait_p50": statistics.median([s.tool_wait_s / s.tool_calls for s in done
                                            if s.tool_calls] or [0.0]),
        "passed": sum(s.passed for s in done), "outcomes": dict(stats.episodes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--episodes", type=int, default=32,
                        help="episodes per level (rounded to whole groups)")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--policy", choices=("cpu", "scripted"), default="cpu")
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()

    from rlfleet.common.testing import unique_run_id
    from rlfleet.envkit.testing import LaunchedPlatform, build_tokenizer, start_scripted_engine

    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-") as tmp:
        engine = None
        if args.policy == "scripted":
            model = build_tokenizer(Path(tmp) / "tokenizer")
            engine, url = start_scripted_engine(model, Path(tmp))
            platform = LaunchedPlatform(Path(tmp) / "run", unique_run_id("bench"), model, engine_url=url)
        else:
            model = default_model()
            platform = LaunchedPlatform(Path(tmp) / "run", unique_run_id("bench"), model, engines=1)
        started = time.perf_counter()
        try:
            platform.up()
            print(f"platform up in {time.perf_counter() - started:.1f}s; policy: {args.policy} ({model}); "
                  f"group size {args.group_size}, temperature {args.temperature}", flush=True)
            for index, concurrency in enumerate(args.concurrency):
                r = asyncio.run(run_level(platform.info, concurrency, args.episodes, args.group_size,
                                          seed=1000 + index, temperature=args.temperature))
                print(f"concurrency {r['concurrency']:>3}: {r['eps']:6.2f} episodes/s  ({r['episodes']} in "
                      f"{r['seconds']:.1f}s)  turns/ep {r['turns']:.2f}  "
                      f"tool calls/ep {r['tool_calls']:.2f}  "
                      f"episode p50 {r['episode_p50']:.2f}s  generate share {r['generate_share']:.0%}  "
                      f"tool call p50 {r['tool_wait_p50'] * 1000:.0f}ms  "
                      f"passed {r['passed']}  {r['outcomes']}", flush=True)
        finally:
            platform.down()
            if engine is not None:
                engine.stop()


if __name__ == "__main__":
    main()
