"""GRPO, GSPO and PPO on calc, the same number of trainer steps each, held-out success side by side.
Prints figures; it is not a pass/fail test.

    .venv/bin/python bench/losses.py                       # 60 steps each, 200 held-out tasks
    .venv/bin/python bench/losses.py --steps 30 --heldout 100 --losses grpo,ppo

Each loss runs `rlfleet run` on its shipped config (examples/calc.toml, calc-gspo.toml, calc-ppo.toml:
the same model, warm start, G, batch, policy learning rate and held-out split; they differ only in
`[trainer.loss]`, and PPO's critic has its own learning rate). The promotion gate is off, so the
final evaluation is of the last version, after exactly `--steps` steps (the time cap is generous so
that no run stops early; a run that does is flagged). The warm start is cached and shared: the
baseline (the SFT policy, version 0) is the same for all three.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench" / "vs_trl"))
from common import run_rlfleet  # noqa: E402  (one runner for the benches' generated configs)

CONFIGS = {"grpo": "calc.toml", "gspo": "calc-gspo.toml", "ppo": "calc-ppo.toml"}


def loss_config(name: str, args, out_dir: Path) -> dict:
    config = tomllib.loads((ROOT / "examples" / CONFIGS[name]).read_text())
    config.update(run_id=f"bench-loss-{name}", run_dir=str(out_dir / name),
                  model_cache_dir=str(ROOT / "runs" / ".cache"))
    config.setdefault("eval", {}).update(heldout=args.heldout, regression=0)
    config["gate"] = {"enabled": False}  # the last version is evaluated, whatever it scores
    config["budget"] = {"max_steps": args.steps, "max_minutes": args.max_minutes}
    return config


def figures(summary: dict) -> dict:
    final = summary["baseline_vs_rl"].get("rl_accepted", {})
    baseline = summary["baseline_vs_rl"].get("baseline", {})
    b, f = baseline.get("task_success"), final.get("task_success")
    return {"steps": summary["steps"], "final_version": summary["final_version"], "wall_s": summary["wall_s"],
            "baseline_success": b, "final_success": f,
            "gain_points": None if b is None or f is None else 100 * (f - b),
            "invalid_tool_calls": final.get("invalid_tool_calls_per_episode")}


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="trainer steps per loss")
    parser.add_argument("--heldout", type=int, default=200,
                        help="held-out tasks in the baseline and final evaluation")
    parser.add_argument("--max-minutes", type=float, default=60.0,
                        help="time cap per run (generous on purpose)")
    parser.add_argument("--losses", default="grpo,gspo,ppo", help="which, in order")
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench-losses"), help="run dirs and results")
    args = parser.parse_args()
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {name: figures(run_rlfleet(loss_config(name, args, out_dir), name, out_dir))
               for name in args.losses.split(",")}
    (out_dir / "results.json").write_text(json.dumps({"steps": args.steps, "heldout": args.heldout,
                                                      "losses": results}, indent=2))
    print(f"\ncalc, {args.steps} trainer steps each, {args.heldout} held-out tasks, "
          "gate off (last version evaluated)")
    rows = [("held-out success: baseline (SFT)", "baseline_success", ".3f"),
            ("held-out success: after RL", "final_success", ".3f"), ("gain (points)", "gain_points", "+.1f"),
            ("invalid tool calls / episode", "invalid_tool_calls", ".2f"), ("steps", "steps", "d"),
            ("loop wall time (s)", "wall_s", ".0f")]
    print(f"{'':34s}" + "".join(f"{n:>10s}" for n in results))
    for label, key, spec in rows:
        print(f"{label:34s}" + "".join(f"{fmt(results[n].get(key), spec):>10s}" for n in results))
    short = [n for n, r in results.items() if r["steps"] < args.steps]
    if short:
        print(f"note: {', '.join(short)} stopped before {args.steps} steps (time cap): not comparable")


if __name__ == "__main__":
    main()
