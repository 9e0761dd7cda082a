"""repo-suite episodes per second through real sandboxes, and where each episode's time goes.

    .venv/bin/python bench/code_episodes.py [--policy scripted|sft] [--concurrency 4 16] [--episodes 32]
                                            [--pool-size N ...] [--group-size 4]

Launches the platform with `rlfleet up --detach` in a temporary run directory (sandbox manager,
gateway, session server, verifier, and an engine), publishes repo train tasks (level 1) as groups
of G, and runs an in-process `RolloutWorker` with the sandbox tool runtime until they are acked.
Every episode takes the path `rlfleet run examples/code.toml` takes: a fresh sandbox (from the
warm pool), the workspace written into it, each tool call a process there, Verify running the hidden
tests in a sandbox of its own, CloseSession, DestroySandbox.

Per level it prints episodes/s and the mean time per episode by phase: sandbox (create + workspace
+ destroy), tool execs, generation, verification. `--pool-size` runs each level once per warm-pool
size (the sandbox manager is restarted for each), so the pool's effect is measured, not guessed.

`--policy scripted` (default) is the ideal policy (rlfleet.envkit.testing: read, fix, test, answer:
three tool calls, four turns), which isolates the platform's cost; `--policy sft` serves the
warm-started base policy of examples/code.toml (built into runs/.cache on first use).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def sft_policy() -> Path:
    from rlfleet.cli.run_config import RunConfig
    from rlfleet.cli.warm_start import ensure_base_policy
    from rlfleet.common.config import load_config

    config = load_config(RunConfig, ["--config", str(ROOT / "examples" / "code.toml")],
                         prog="bench", environ={})
    return ensure_base_policy(ROOT / "runs" / ".cache", config.model, config.warm_start, config.system_prompt,
                              suite=config.suite)


async def run_level(info, concurrency: int, episodes: int, group_size: int, seed: int) -> dict:
    from rlfleet.envkit.submit import publish_tasks, write_for_verifier
    from rlfleet.envkit.suites import repo
    from rlfleet.envkit.worker import RolloutWorker
    from rlfleet.envkit.worker_config import WorkerConfig

    n_tasks = max(1, episodes // group_size)
    tasks = repo.generate_tasks("train", n_tasks, seed=seed)
    write_for_verifier(tasks, info.suites_dir)
    await publish_tasks(tasks, info.run_id, info.nats_url, group_size, epoch=seed, temperature=1.0)
    config = WorkerConfig(run_id=info.run_id, nats={"url": info.nats_url},
                          session_address=info.session_address,
                          sandbox_address=info.sandbox_address, verifier_address=info.verifier_address,
                          concurrency=concurrency, episode_timeout_s=120, tool_runtime="sandbox")
    started = time.perf_counter()
    stats = await RolloutWorker(config).run_until(n_tasks)
    elapsed = time.perf_counter() - started
    done = [s for s in stats.recent if s.end != "error"]

    def mean(values):
        return statistics.mean(values) if values else 0.0

    return {"concurrency": concurrency, "episodes": len(done), "seconds": elapsed, "eps": len(done) / elapsed,
            "sandbox": mean([s.sandbox_s for s in done]), "tools": mean([s.tool_wait_s for s in done]),
            "generation": mean([s.generate_s for s in done]),
            "verification": mean([s.verify_s for s in done]),
            "episode": mean([s.episode_s for s in done]), "tool_calls": mean([s.tool_calls for s in done]),
            "exec_ms": 1000 * sum(s.tool_wait_s for s in done) / max(1, sum(s.tool_calls for s in done)),
            "passed": sum(s.passed for s in done), "outcomes": dict(stats.episodes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", choices=("scripted", "sft"), default="scripted")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--episodes", type=int, default=32,
                        help="episodes per level (rounded to whole groups)")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--pool-size", type=int, nargs="+", default=[0],
                        help="warm-pool sizes to compare; 0: "
                             "sized to the concurrency (+2), as rlfleet run does")
    args = parser.parse_args()

    from rlfleet.common.testing import unique_run_id
    from rlfleet.envkit.testing import LaunchedPlatform, build_tokenizer, start_scripted_engine

    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-code-") as tmp:
        engine, url = None, ""
        if args.policy == "scripted":
            model = build_tokenizer(Path(tmp) / "tokenizer")
            engine, url = start_scripted_engine(model, Path(tmp))
        else:
            model = sft_policy()
        try:
            for pool in args.pool_size:
                for index, concurrency in enumerate(args.concurrency):
                    size = pool or concurrency + 2
                    platform = LaunchedPlatform(Path(tmp) / f"run-{pool}-{concurrency}",
                                                unique_run_id("bench"), model, engine_url=url, engines=1,
                                                sections={"sandbox": {"driver.pool_size": size}})
                    started = time.perf_counter()
                    try:
                        platform.up()
                        up_s = time.perf_counter() - started
                        r = asyncio.run(run_level(platform.info, concurrency, args.episodes, args.group_size,
                                                  seed=2000 + index))
                    finally:
                        platform.down()
                    print(f"{args.policy} pool {size:>3} concurrency {r['concurrency']:>3}: "
                          f"{r['eps']:5.2f} episodes/s ({r['episodes']} in {r['seconds']:.1f}s, "
                          f"platform up {up_s:.0f}s)  per episode: sandbox "
                          f"{r['sandbox']:.2f}s  tool execs {r['tools']:.2f}s ({r['tool_calls']:.1f} calls, "
                          f"{r['exec_ms']:.0f} ms each)  generation {r['generation']:.2f}s  verification "
                          f"{r['verification']:.2f}s  episode {r['episode']:.2f}s  passed {r['passed']}  "
                          f"{r['outcomes']}", flush=True)
        finally:
            if engine is not None:
                engine.stop()


if __name__ == "__main__":
    main()
