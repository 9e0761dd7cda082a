"""Configuration of `rlfleet run`: the asynchronous RL loop on one task suite."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rlfleet.cli.gate import GateConfig
from rlfleet.cli.warm_start import ModelSpec, WarmStartConfig
from rlfleet.common.config import StrictModel


class ToolLatencyConfig(StrictModel):
    """Extra latency added to every tool call, to model slow tools (long-tailed by default)."""

    distribution: Literal["none", "constant", "lognormal"] = Field("none", description="none | constant | lognormal")
    median_s: float = Field(0.5, ge=0, description="median added latency")
    sigma: float = Field(1.0, ge=0, description="lognormal shape: larger = heavier tail")
    max_s: float = Field(20.0, ge=0, description="cap on one draw")


class RolloutConfig(StrictModel):
    concurrency: int = Field(32, ge=1, description="episodes running at once")
    temperature: float = Field(1.0, ge=0, description="sampling temperature of rollouts")
    max_staleness: int = Field(6, ge=0, description="versions a trajectory may lag the trainer (admission and trainer)")
    max_inflight_sessions: int = Field(64, ge=1, description="admission limit on open sessions")
    backlog_groups: int = Field(8, ge=1, description="tasks kept waiting in TASKS beyond those running")
    tool_latency: ToolLatencyConfig = Field(default_factory=ToolLatencyConfig)
    tool_runtime: Literal["sandbox", "in_process"] = Field(
        "in_process", description="in_process: the calc tool (a pure function) runs in the rollout worker, with "
        "no sandbox per episode; sandbox: a fresh sandbox per episode and a sandboxed process per call")


class TrainerSettings(StrictModel):
    loss: Literal["grpo", "gspo", "ppo"] = Field("grpo", description="RL loss")
    lr: float = Field(5e-5, gt=0, description="learning rate")
    groups_per_step: int = Field(8, ge=1, description="groups per optimizer step")
    torch_threads: int = Field(1, ge=1, description="torch threads of the trainer")


class EvalConfig(StrictModel):
    heldout: int = Field(200, ge=1, description="held-out tasks per evaluation")
    regression: int = Field(50, ge=0, description="fixed regression tasks per evaluation")
    temperature: float = Field(1.0, ge=0, description="sampling temperature of evaluation episodes")
    concurrency: int = Field(64, ge=1, description="evaluation episodes at once")


class BudgetConfig(StrictModel):
    max_steps: int = Field(40, ge=1, description="stop after this many trainer steps")
    max_minutes: float = Field(10.0, gt=0, description="stop the loop after this long (warm start not counted)")


class RunConfig(StrictModel):
    """`rlfleet run`: warm start, baseline, then the RL loop with a promotion gate, and a report."""

    run_id: str = Field("calc", pattern=r"^[A-Za-z0-9_-]{1,64}$", description="run namespace")
    run_dir: str = Field("", description="run directory; empty = runs/<run_id>")
    mode: Literal["async", "sync"] = Field("async", description="async (overlapped) or sync (lock-step, on-policy)")
    seed: int = Field(0, ge=0, description="seed of task order and sampling")
    suite: Literal["calc"] = Field("calc", description="task suite")
    difficulty: int = Field(1, ge=1, le=3, description="calc difficulty")
    group_size: int = Field(8, ge=2, description="samples per task (G)")
    system_prompt: bool = Field(False, description="put the suite's system prompt in front of every task")
    model: ModelSpec = Field(default_factory=ModelSpec)
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerSettings = Field(default_factory=TrainerSettings)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    gate: GateConfig = Field(default_factory=GateConfig)
    budget: BudgetConfig = Field(default_factory=BudgetConfig)
    model_cache_dir: str = Field("", description="base policies are cached here; empty = runs/.cache")
    overrides: dict[str, dict[str, Any]] = Field(default_factory=dict,
                                                 description="extra per-service config, as in `rlfleet up`")

    @model_validator(mode="after")
    def _staleness_covers_the_gate(self) -> RunConfig:
        # With a gate, the canary (rollout) engines get a version every `every_versions`; rollouts of
        # an older one must still be trainable, or the loop would starve between syncs.
        if self.mode == "async" and self.gate.enabled and self.rollout.max_staleness < self.gate.every_versions:
            raise ValueError(f"rollout.max_staleness ({self.rollout.max_staleness}) must be at least "
                             f"gate.every_versions ({self.gate.every_versions})")
        return self
