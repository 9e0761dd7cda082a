"""The promotion gate: a candidate version is accepted only when it is better where it counts.

Accepted when held-out task success improves on the last accepted version by at least
`min_success_gain`, the fixed regression set does not drop by more than `max_regression_drop`, and
invalid tool calls, safety violations and time to completion rise by no more than their thresholds.
Every decision is recorded with its reasons, accepted or not.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from rlfleet.cli.report import EvalResult
from rlfleet.common.config import StrictModel


class GateConfig(StrictModel):
    enabled: bool = Field(True, description="evaluate candidates and promote only those that pass")
    every_versions: int = Field(5, ge=1, description="evaluate a candidate every this many policy versions")
    min_success_gain: float = Field(0.0, description="held-out success must beat the accepted version by more than this")
    max_regression_drop: float = Field(0.05, ge=0, description="largest allowed drop on the regression set")
    max_invalid_tool_call_rise: float = Field(0.05, ge=0, description="largest allowed rise in invalid tool calls per episode")
    max_safety_violation_rise: float = Field(0.0, ge=0, description="largest allowed rise in safety violations per episode")
    max_time_to_completion_rise: float = Field(
        1.0, ge=0, description="largest allowed relative rise in mean episode time (generous: a candidate is "
        "measured on the canary while it also serves rollouts, the accepted version was not)")


@dataclass
class Decision:
    accepted: bool
    reasons: list[str]


def decide(config: GateConfig, candidate: EvalResult, accepted: EvalResult,
           candidate_regression: EvalResult | None = None, accepted_regression: EvalResult | None = None) -> Decision:
    reasons, refused = [], False
    gain = candidate.success - accepted.success
    if gain > config.min_success_gain:
        reasons.append(f"held-out success {accepted.success:.3f} -> {candidate.success:.3f} (+{gain:.3f})")
    else:
        refused = True
        reasons.append(f"held-out success {accepted.success:.3f} -> {candidate.success:.3f}: "
                       f"gain {gain:+.3f} not above {config.min_success_gain:+.3f}")
    if candidate_regression is not None and accepted_regression is not None:
        drop = accepted_regression.success - candidate_regression.success
        if drop > config.max_regression_drop:
            refused = True
            reasons.append(f"regression set success dropped by {drop:.3f} (> {config.max_regression_drop:.3f})")
    checks = (
        ("invalid tool calls per episode", candidate.invalid_tool_calls - accepted.invalid_tool_calls,
         config.max_invalid_tool_call_rise),
        ("safety violations per episode", candidate.safety_violations - accepted.safety_violations,
         config.max_safety_violation_rise),
    )
    for name, rise, limit in checks:
        if rise > limit:
            refused = True
            reasons.append(f"{name} rose by {rise:.3f} (> {limit:.3f})")
    if accepted.time_to_completion_s > 0:
        relative = candidate.time_to_completion_s / accepted.time_to_completion_s - 1
        if relative > config.max_time_to_completion_rise:
            refused = True
            reasons.append(f"time to completion rose by {relative:.0%} (> {config.max_time_to_completion_rise:.0%})")
    return Decision(not refused, reasons)
