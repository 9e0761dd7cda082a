"""Simulated gate decisions: how often the gate promotes, for a given true gain (tests, bench/gate.py).

Each held-out task i has a true success probability p_i for the accepted version (drawn once per
simulated set from a Beta distribution spread like the calc suite's at temperature 1) and p_i +
gain (clipped to [0, 1]) for the candidate. One evaluation draws one episode per task and version:

- `coupled=False`: independent draws for the two versions (fresh sampling randomness each time:
  an engine without seeds, or a version evaluated again with other seeds): the worst case for the test;
- `coupled=True`: one uniform draw u_i per task shared by both (pass when u_i < p), the model of
  evaluations with the same sampling seed: equal weights give equal results, and a better policy
  loses a task only where it really is worse.

The gate then runs exactly as in `rlfleet run`: interim looks after each slice (refusing early when
it can), the decision on all tasks at the end.
"""

from __future__ import annotations

import numpy as np

from rlfleet.cli.gate import GateConfig, decide, interim, merge, slices
from rlfleet.cli.report import EvalResult, TaskOutcome


def task_probabilities(rng: np.random.Generator, n: int, mean: float = 0.5,
                       spread: float = 2.0) -> np.ndarray:
    """n per-task success probabilities, Beta-distributed around `mean` (spread: a + b)."""
    return rng.beta(mean * spread, (1 - mean) * spread, size=n)


def evaluation(passed: np.ndarray, version: int, ids: list[str]) -> EvalResult:
    tasks = [TaskOutcome(task_id, bool(p), 0, 0, 0.0) for task_id, p in zip(ids, passed, strict=True)]
    n = len(tasks) or 1
    return EvalResult(version=version, split="heldout", episodes=len(tasks), success=float(passed.sum()) / n,
                      invalid_tool_calls=0.0, safety_violations=0.0, time_to_completion_s=0.0,
                      interactions=0.0, elapsed_s=0.0, label="candidate", tasks=tasks)


def one_gate(config: GateConfig, rng: np.random.Generator, p_accepted: np.ndarray, gain: float,
             coupled: bool) -> tuple[bool, int]:
    """One simulated gate: (promoted, tasks the candidate was evaluated on)."""
    n = len(p_accepted)
    ids = [f"t{i}" for i in range(n)]
    p_candidate = np.clip(p_accepted + gain, 0.0, 1.0)
    u = rng.random(n)
    accepted = evaluation((u < p_accepted).astype(float), 0, ids)
    drawn = (u if coupled else rng.random(n)) < p_candidate
    parts = []
    for start, end in slices(n, config.looks):
        parts.append(evaluation(drawn[start:end].astype(float), 1, ids[start:end]))
        if end < n and interim(config, merge(parts), accepted):
            return False, end
    return decide(config, merge(parts), accepted).accepted, n


def promotion_rate(config: GateConfig, *, gain: float, n_tasks: int, trials: int, coupled: bool,
                   seed: int = 0) -> tuple[float, float]:
    """(share of trials promoted, mean tasks evaluated per candidate)."""
    rng = np.random.default_rng(seed)
    promoted, tasks = 0, 0
    for _ in range(trials):
        p = task_probabilities(rng, n_tasks)
        ok, used = one_gate(config, rng, p, gain, coupled)
        promoted += ok
        tasks += used
    return promoted / trials, tasks / trials
