"""The same RL workload in async and sync mode, one after the other in one command, with tool
latencies drawn from a long-tailed distribution. Prints figures; it is not a pass/fail test.

    .venv/bin/python bench/async_vs_sync.py                          # 30 steps each, lognormal tools
    .venv/bin/python bench/async_vs_sync.py --steps 20 --median-s 1.0 --sigma 1.5 --concurrency 64

Both modes run `rlfleet run` on the same config (examples/calc.toml's model, warm start, G, batch,
learning rate and held-out split) for the same number of trainer steps, so they end at comparable
success and differ in how long that took:

- async: rollouts, training and weight shipping overlap; rollouts stay within the staleness bound;
- sync: lock-step and on-policy: one step's groups, wait for all of them (the slowest tool call
  included), train, wait for the new version to be served, repeat.

Each tool call sleeps a draw from lognormal(median, sigma), capped (`rollout.tool_latency`). Figures
per mode come from the run's summary.json: trajectories/s over the loop, trainer idle fraction (the
trainer's own data-wait share), held-out success over time (the gate's evaluations), the time to a
target held-out success, and the wall time of the loop. The warm start is cached and shared, so it
is built once and costs neither mode.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench" / "vs_trl"))
from common import run_rlfleet, to_toml  # noqa: E402,F401  (to_toml: the tests write the per-mode configs with it)


def mode_config(base: dict, mode: str, args, out_dir: Path) -> dict:
    config = json.loads(json.dumps(base))
    config.update(run_id=f"bench-{mode}", run_dir=str(out_dir / mode), mode=mode,
                  model_cache_dir=str(ROOT / "runs" / ".cache"))
    config.setdefault("rollout", {})["tool_latency"] = {
        "distribution": "lognormal", "median_s": args.median_s, "sigma": args.sigma, "max_s": args.max_s}
    if args.concurrency:
        config["rollout"]["concurrency"] = args.concurrency
        # Room at admission for the rollouts and the gate's evaluation episodes at once.
        config["rollout"]["max_inflight_sessions"] = (args.concurrency
                                                      + config.get("eval", {}).get("concurrency", 64))
    config.setdefault("eval", {})["regression"] = 0  # the gate's regression set only slows both modes alike
    config["eval"]["heldout"] = args.heldout
    config.setdefault("gate", {})["every_versions"] = args.eval_every
    config["budget"] = {"max_steps": args.steps, "max_minutes": args.max_minutes}
    return config


def time_to(curve: list[dict], target: float) -> float | None:
    """Loop seconds at the first held-out evaluation reaching `target` (the final one included)."""
    for point in sorted(curve, key=lambda p: p["elapsed_s"]):
        if point["success"] >= target:
            return point["elapsed_s"]
    return None


def figures(summary: dict, target: float) -> dict:
    curve = summary.get("heldout_curve", [])
    final = summary["baseline_vs_rl"].get("rl_accepted", {})
    baseline = summary["baseline_vs_rl"].get("baseline", {})
    return {
        "steps": summary["steps"], "wall_s": summary["wall_s"],
        "trajectories_per_s": summary["trajectories"]["per_second"],
        "trained_tokens_per_s": summary.get("trained_tokens_per_s", 0.0),
        "trainer_idle_fraction": summary["trainer_idle_fraction"],
        "gate_wait_s": summary.get("gate_wait_s", 0.0),
        "baseline_success": baseline.get("task_success"),
        "final_success": final.get("task_success"),
        "best_heldout_success": max((p["success"] for p in curve), default=None),
        "time_to_target_s": time_to([p for p in curve if p["label"] != "baseline"], target),
        "staleness_max": summary["staleness"]["max"],
        "tool_wait_p50_s": summary["tool_wait_s"]["p50"], "tool_wait_p99_s": summary["tool_wait_s"]["p99"],
        "peak_rss_mb": summary.get("peak_rss_mb"),
    }


def fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "examples" / "calc.toml"), help="base run config")
    parser.add_argument("--steps", type=int, default=30, help="trainer steps per mode")
    parser.add_argument("--max-minutes", type=float, default=25.0, help="time cap per mode")
    parser.add_argument("--median-s", type=float, default=0.3, help="median added tool latency")
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal shape (tail weight)")
    parser.add_argument("--max-s", type=float, default=10.0, help="cap on one tool-latency draw")
    parser.add_argument("--concurrency", type=int, default=0,
                        help="episodes at once in both modes (default: the config's); slow tools want more")
    parser.add_argument("--heldout", type=int, default=100, help="held-out tasks per evaluation")
    parser.add_argument("--eval-every", type=int, default=5, help="evaluate every this many versions")
    parser.add_argument("--target", type=float, default=0.45, help="held-out success to time")
    parser.add_argument("--modes", default="async,sync", help="modes to run, in order")
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench-async-vs-sync"),
                        help="run dirs and results")
    args = parser.parse_args()

    base = tomllib.loads(Path(args.config).read_text())
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"workload": {"config": args.config, "steps": args.steps, "concurrency": args.concurrency or
                            base.get("rollout", {}).get("concurrency"), "tool_latency": {
        "distribution": "lognormal", "median_s": args.median_s, "sigma": args.sigma, "max_s": args.max_s},
        "heldout": args.heldout, "target_success": args.target}, "modes": {}}
    for mode in args.modes.split(","):
        summary = run_rlfleet(mode_config(base, mode, args, out_dir), mode, out_dir)
        results["modes"][mode] = figures(summary, args.target)

    modes = results["modes"]
    print(f"\nsame workload, {args.steps} steps each; tool latency lognormal(median {args.median_s} s, "
          f"sigma {args.sigma}, cap {args.max_s} s); target held-out success {args.target}")
    rows = [("trajectories/s", "trajectories_per_s", ".2f"),
            ("trained tokens/s", "trained_tokens_per_s", ".0f"),
            ("trainer idle fraction", "trainer_idle_fraction", ".2f"),
            ("loop wall time (s)", "wall_s", ".0f"),
            ("steps", "steps", "d"), (f"time to held-out {args.target} (s)", "time_to_target_s", ".0f"),
            ("held-out success: baseline", "baseline_success", ".3f"),
            ("held-out success: final", "final_success", ".3f"),
            ("best held-out success", "best_heldout_success", ".3f"),
            ("max staleness", "staleness_max", "d"),
            ("tool wait p50 / episode (s)", "tool_wait_p50_s", ".2f"),
            ("gate wait (s, sync only)", "gate_wait_s", ".0f"), ("peak RSS (MB)", "peak_rss_mb", ".0f")]
    names = list(modes)
    print(f"{'':32s}" + "".join(f"{n:>12s}" for n in names))
    for label, key, spec in rows:
        print(f"{label:32s}" + "".join(f"{fmt(modes[n].get(key), spec):>12s}" for n in names))
    if "async" in modes and "sync" in modes:
        a, s = modes["async"], modes["sync"]
        ratios = {"throughput": a["trajectories_per_s"] / s["trajectories_per_s"]
                  if s["trajectories_per_s"] else None,
                  "wall_time": s["wall_s"] / a["wall_s"] if a["wall_s"] else None,
                  "time_to_target": (s["time_to_target_s"] / a["time_to_target_s"]
                                     if a["time_to_target_s"] and s["time_to_target_s"] else None)}
        results["ratios_async_over_sync"] = ratios
        print(f"\nasync / sync: throughput {fmt(ratios['throughput'])}x, wall time for the same steps "
              f"{fmt(ratios['wall_time'])}x shorter, time to target {fmt(ratios['time_to_target'])}x sooner")
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    print(f"results: {out_dir / 'results.json'}")


if __name__ == "__main__":
    main()
