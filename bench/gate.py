"""The promotion gate's false-promotion rate and power, simulated with the gate's own decision code.
Prints figures; it is not a pass/fail test.

    .venv/bin/python bench/gate.py                          # the defaults of `rlfleet run` ([gate], [eval])
    .venv/bin/python bench/gate.py --tasks 200 --alpha 0.05 --looks 4 --trials 2000 --gains 0,0.02,0.05,0.1

Each trial draws per-task success probabilities (Beta, mean 0.5: the calc suite at temperature 1),
one evaluation of the accepted version and one of a candidate whose true success is higher by the
gain, and runs the gate exactly as `rlfleet run` does (interim looks that may refuse early, the
decision on all tasks at the end; `rlfleet.cli.gate_sim`). Two models of the candidate's draws:

- seeded: the same sampling seed per task for both versions (`eval.seeded = true`, the default):
  equal weights give equal results;
- unseeded: fresh randomness for each evaluation, the worst case for the test.

For comparison, the old gate (promote on any point gain above 0 of one evaluation each).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from rlfleet.cli.gate import GateConfig
from rlfleet.cli.gate_sim import promotion_rate, task_probabilities
from rlfleet.cli.run_config import RunConfig


def old_gate_rate(gain: float, n_tasks: int, trials: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    promoted = 0
    for _ in range(trials):
        p = task_probabilities(rng, n_tasks)
        promoted += (rng.random(n_tasks) < np.clip(p + gain, 0, 1)).mean() > (rng.random(n_tasks) < p).mean()
    return promoted / trials


def main() -> None:
    defaults = RunConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=defaults.eval.heldout,
                        help="held-out tasks per evaluation")
    parser.add_argument("--alpha", type=float, default=defaults.gate.alpha)
    parser.add_argument("--looks", type=int, default=defaults.gate.looks)
    parser.add_argument("--min-gain", type=float, default=defaults.gate.min_success_gain)
    parser.add_argument("--trials", type=int, default=2000)
    parser.add_argument("--gains", default="0,0.02,0.05,0.1,0.15")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = GateConfig(alpha=args.alpha, looks=args.looks, min_success_gain=args.min_gain)
    gains = [float(g) for g in args.gains.split(",")]
    print(f"gate: alpha {config.alpha}, looks {config.looks}, min gain {config.min_success_gain}, "
          f"{args.tasks} held-out tasks, {args.trials} trials per row (sd of a rate r: sqrt(r(1-r)/trials))")
    print(f"{'true gain':>10} {'seeded: promoted':>17} {'tasks run':>10} {'unseeded: promoted':>19} "
          f"{'tasks run':>10} {'old gate: promoted':>19}")
    began = time.monotonic()
    for gain in gains:
        seeded, seeded_tasks = promotion_rate(config, gain=gain, n_tasks=args.tasks, trials=args.trials,
                                              coupled=True, seed=args.seed)
        fresh, fresh_tasks = promotion_rate(config, gain=gain, n_tasks=args.tasks, trials=args.trials,
                                            coupled=False, seed=args.seed + 1)
        old = old_gate_rate(gain, args.tasks, args.trials, args.seed + 2)
        print(f"{gain:>10.3f} {seeded:>17.3f} {seeded_tasks:>10.1f} {fresh:>19.3f} "
              f"{fresh_tasks:>10.1f} {old:>19.3f}")
    print("(the gain-0 row is the false-promotion rate; the others are power)  "
          f"{time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
