"""The calc loop of `make run` once per weight transport, at equal steps (issue 16: "the `make run` loop
runs with each transport (one config switch) and learns the same"). Prints figures; not a pass/fail
test.

Runs `rlfleet run examples/calc.toml` one transport after the other (never side by side: each brings
a whole platform up), changing only `broker.sync.transport` (`make run RUN_ARGS="--broker.sync.transport
p2p"` is the same switch), with the same seed and the same cached warm start, so version 0 of every
run is the same model. As in `bench/lora_vs_full.py`, the step budget ends each run (the time budget
is raised) and the gate is off, so the final held-out evaluation is of the last step's version in
every run; a run that ended early is named.

Per run: steps, held-out success of the baseline and of the final version, the curve, wall time,
and how the trainer's versions reached the engines (the broker's per-engine transport and updates,
from the run's metrics in `summary.json` where present).

    .venv/bin/python bench/transport_runs.py                      # disk_delta, distributed, p2p, tensor
    .venv/bin/python bench/transport_runs.py --transports disk_delta,p2p --steps 30
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from lora_vs_full import ROOT, describe, run_one, success

TRANSPORTS = ("disk_delta", "distributed", "p2p", "tensor")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transports", default=",".join(TRANSPORTS), help="comma-separated, in run order")
    parser.add_argument("--steps", type=int, default=60, help="step budget of every run")
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "calc.toml")
    parser.add_argument("--runs-dir", type=Path, help="where the runs go (default: a temporary directory)")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE for every run")
    parser.add_argument("--json", type=Path, help="also write the summaries here")
    args = parser.parse_args()
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    unknown = sorted(set(transports) - {*TRANSPORTS, "disk_full"})
    if unknown:
        raise SystemExit(f"unknown transports {unknown}; known: {', '.join(TRANSPORTS)}, disk_full")
    with tempfile.TemporaryDirectory(prefix="transport-runs-") as tmp:
        runs_dir = args.runs_dir or Path(tmp)
        runs_dir.mkdir(parents=True, exist_ok=True)
        summaries = {}
        for transport in transports:
            extra = [f"broker.sync.transport={transport}", *args.set]
            summaries[transport] = run_one(f"t-{transport}", args.config, args.steps,
                                           runs_dir / f"t-{transport}", extra, runs_dir)
            print("\n".join(describe(transport, summaries[transport], args.steps)), flush=True)
    print("\nside by side (held-out success, final version of each run):")
    reference = success(summaries[transports[0]], "rl_accepted")
    for transport, summary in summaries.items():
        final = success(summary, "rl_accepted")
        gap = "" if reference is None or final is None else f" ({final - reference:+.3f} vs {transports[0]})"
        print(f"  {transport:>12}: baseline {success(summary, 'baseline')} -> {final}{gap}; "
              f"steps {summary.get('steps')}/{args.steps}; wall {summary['_bench_wall_s']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(summaries, indent=1, default=str))


if __name__ == "__main__":
    main()
