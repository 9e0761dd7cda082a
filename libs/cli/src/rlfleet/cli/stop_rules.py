"""The run's stop rules: a verifier that disagrees with the labels, a long tail that costs more than it buys.

1. Verifier audit. `rlfleet run` sends a fixed subset of the labelled audit set (written by
   `python -m rlfleet.verifier.audit_set write`, labels true by construction: right and wrong
   answers, reference, perturbed and hacking solutions) to the run's own verifier service
   (`Audit`), before the loop and before each promotion (a resumed run that passed its first one
   goes on to its next promotion's, so that a restart is not held up). By default the subset is
   drawn from the labelled episodes scored by the verifier kinds the run's own tasks use: a calc
   run's rewards never depend on the unit-test kind, whose hacking solutions cost a sandbox and up
   to 4 s of tests each (`audit.scope = "all"`: every suite). When a false-positive or false-negative
   rate, overall or of one suite, passes its threshold, the run stops: a reward the verifier hands
   out wrongly is what the policy learns, and a promotion measured by it means nothing.
2. Long-tail account. The generated tokens of training trajectories that bought no clean sample
   (aborted, failed, truncated, or older than the staleness bound and so dropped as stale by the
   trainer) and of evaluation episodes run again after an outage, set against the held-out success
   gained since the baseline, in points (1 point = 1% of tasks). When the tokens per point pass
   the threshold (no gain with a long tail spent: infinitely many), the run says so in its report
   and `rlfleet status`, and stops when `action = "stop"`.

Pure functions of what the driver already holds; the RPCs stay in rl_loop.py.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pydantic import Field

from rlfleet.cli.report import TrajectoryRecord
from rlfleet.common.config import StrictModel

LONG_TAIL_STATUSES = ("aborted", "failed", "truncated")


class AuditConfig(StrictModel):
    enabled: bool = Field(True, description="audit the run's verifier against the labelled audit set before "
                          "the loop and before each promotion; stop the run when it disagrees too often")
    episodes: int = Field(40, ge=1, le=500, description="labelled episodes per audit (a fixed subset drawn "
                          "by `seed`; hacking solutions cost up to their 4 s test budget each)")
    seed: int = Field(0, ge=0, description="seed of the audit set and of the subset drawn from it")
    scope: Literal["run", "all"] = Field(
        "run", description="run: the labelled episodes of the verifier kinds the run's tasks are scored "
        "with (all of them when none is labelled); all: every suite and label")
    max_false_positive_rate: float = Field(0.0, ge=0, le=1, description="stop when the verifier passes more "
                                           "than this share of the failing episodes "
                                           "(overall or of one suite)")
    max_false_negative_rate: float = Field(0.05, ge=0, le=1, description="stop when the verifier fails more "
                                           "than this share of the passing episodes "
                                           "(overall or of one suite)")
    timeout_s: float = Field(300.0, gt=0, description="deadline of one Audit call")


class LongTailConfig(StrictModel):
    enabled: bool = Field(True,
                          description="account the compute of long-tail trajectories against held-out gain")
    max_tokens_per_point: float = Field(
        5000.0, gt=0, description="generated tokens spent on the long tail per point (1%) of held-out "
        "success gained over the baseline, above which the rule fires")
    min_tokens: int = Field(20000, ge=0,
                            description="no verdict until the long tail has cost this many tokens")
    action: Literal["report", "stop"] = Field("report", description="report: say so in the report and "
                                              "`rlfleet status`; stop: also end the loop (the "
                                              "final evaluation runs)")


# ---------------------------------------------------------------------------------------------
# Audit


def audit_subset(labels: list[dict], n: int, seed: int) -> list[dict]:
    """A fixed subset of n labelled episodes with each (suite, label) stratum represented: drawn
    round-robin over the strata, each stratum shuffled by `seed`."""
    rng = random.Random(seed)
    strata: dict[tuple[str, bool], list[dict]] = {}
    for label in labels:
        strata.setdefault((label.get("suite", ""), bool(label["human_passed"])), []).append(label)
    queues = [rng.sample(items, len(items)) for _, items in sorted(strata.items())]
    chosen: list[dict] = []
    while len(chosen) < min(n, len(labels)):
        for queue in queues:
            if queue and len(chosen) < n:
                chosen.append(queue.pop())
    return chosen


@dataclass
class AuditResult:
    when: str
    n: int
    false_positive_rate: float
    false_negative_rate: float
    suites: dict[str, dict[str, float]]
    breaches: list[str]
    disagreements: list[str]

    def line(self) -> str:
        head = (f"verifier audit ({self.when}): {self.n} labelled episodes, false positive rate "
                f"{self.false_positive_rate:.3f}, false negative rate {self.false_negative_rate:.3f}")
        return head + ("" if not self.breaches else "; " + "; ".join(self.breaches))


def audit_result(report: Any, when: str, config: AuditConfig) -> AuditResult:
    """From a `verifier.v1.AuditReport`: the rates and one message per rate above its threshold."""
    rates = {"": (report.n, report.false_positive_rate, report.false_negative_rate)}
    rates |= {s.suite: (s.n, s.false_positive_rate, s.false_negative_rate) for s in report.suites}
    breaches = []
    for suite, (_, fp, fn) in rates.items():
        where = f"suite {suite!r}" if suite else "the audit set"
        if fp > config.max_false_positive_rate:
            breaches.append(f"the verifier passes {fp:.1%} of the failing episodes of {where} "
                            f"(max {config.max_false_positive_rate:.1%})")
        if fn > config.max_false_negative_rate:
            breaches.append(f"the verifier fails {fn:.1%} of the passing episodes of {where} "
                            f"(max {config.max_false_negative_rate:.1%})")
    wrong = [f"{d.episode_id} (label {'passed' if d.human_passed else 'failed'}, verifier "
             f"{'passed' if d.verifier_passed else 'failed'})" for d in report.disagreements][:20]
    suites = {s: {"n": n, "false_positive_rate": fp, "false_negative_rate": fn}
              for s, (n, fp, fn) in rates.items() if s}
    return AuditResult(when, report.n, report.false_positive_rate, report.false_negative_rate, suites,
                       breaches, wrong)


# ---------------------------------------------------------------------------------------------
# Long tail


@dataclass
class LongTail:
    tokens: dict[str, int]          # generated tokens per kind of long tail
    trajectories: dict[str, int]    # trajectories (episodes) per kind
    total_tokens: int               # every training trajectory's generated tokens
    gain_points: float              # held-out success of the accepted version minus the baseline's, x 100
    tokens_per_point: float         # long-tail tokens / gain_points (inf without a gain)
    fired: bool
    message: str

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        per_point = self.tokens_per_point
        out["tokens_per_point"] = None if math.isinf(per_point) else round(per_point, 1)
        return out


def long_tail(trajectories: list[TrajectoryRecord], *, max_staleness: int, eval_retried: int, gain: float,
              config: LongTailConfig) -> LongTail:
    """The account at this point of the run: each training trajectory counts once, by its first
    long-tail kind (a truncated trajectory that is also stale counts as truncated)."""
    train = [t for t in trajectories if t.split == "train"]
    tokens = {k: 0 for k in (*LONG_TAIL_STATUSES, "stale", "retried")}
    counts = dict.fromkeys(tokens, 0)
    for t in train:
        stale = "stale" if t.staleness > max_staleness else ""
        kind = t.status if t.status in LONG_TAIL_STATUSES else stale
        if kind:
            tokens[kind] += t.generated
            counts[kind] += 1
    mean_tokens = sum(t.generated for t in train) / len(train) if train else 0.0
    counts["retried"] = eval_retried
    tokens["retried"] = round(eval_retried * mean_tokens)  # their trajectories are not kept: at the mean
    spent = sum(tokens.values())
    points = gain * 100
    per_point = spent / points if points > 0 else (math.inf if spent else 0.0)
    fired = config.enabled and spent >= config.min_tokens and per_point > config.max_tokens_per_point
    shown = "no held-out gain" if math.isinf(per_point) else f"{per_point:.0f} tokens per point"
    message = (f"the long tail cost {spent} generated tokens ({_share(spent, train)} of the rollouts) for "
               f"{points:+.1f} points of held-out success: {shown}"
               + (f", above {config.max_tokens_per_point:.0f}" if fired else ""))
    return LongTail(tokens, counts, sum(t.generated for t in train), points, per_point, fired, message)


def _share(spent: int, train: list[TrajectoryRecord]) -> str:
    total = sum(t.generated for t in train)
    return f"{spent / total:.1%}" if total else "-"
