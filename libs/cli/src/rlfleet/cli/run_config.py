"""Configuration of `rlfleet run`: the asynchronous RL loop on one task suite.

The run's own keys (task suite, rollouts, evaluation, gate, budget) sit beside the real config of
every service (`ServiceSections`: `[trainer]`, `[gateway]`, `[broker]`, ...), resolved and checked
once, here. What the run decides for everyone is handed down by `_hand_down` (prime-rl's shared
fields): `run_id`, `group_size`, `rollout.max_staleness`, `rollout.max_inflight_sessions` and `seed`
must not be set to something else in a section; what the run derives from its mode and gate
(auto-promotion, the broker's sync cadence, the pools that take rollouts) a section may still set.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rlfleet.cli.gate import GateConfig
from rlfleet.cli.platform_config import RestartPolicy, ServiceSections
from rlfleet.cli.stop_rules import AuditConfig, LongTailConfig
from rlfleet.cli.warm_start import ModelSpec, WarmStartConfig
from rlfleet.common.config import StrictModel, merge, propagate

# Where `rlfleet run` starts from a different default than the services' own (a short CPU run).
RUN_DEFAULTS: dict[str, Any] = {"trainer": {"groups_per_step": 8, "torch_threads": 1, "optim": {"lr": 5e-5}}}


class ToolLatencyConfig(StrictModel):
    """Extra latency added to every tool call, to model slow tools (long-tailed by default)."""

    distribution: Literal["none", "constant", "lognormal"] = Field(
        "none", description="none | constant | lognormal")
    median_s: float = Field(0.5, ge=0, description="median added latency")
    sigma: float = Field(1.0, ge=0, description="lognormal shape: larger = heavier tail")
    max_s: float = Field(20.0, ge=0, description="cap on one draw")


class RolloutConfig(StrictModel):
    concurrency: int = Field(32, ge=1, description="episodes running at once")
    temperature: float = Field(1.0, ge=0, description="sampling temperature of rollouts")
    max_staleness: int = Field(6, ge=0, description="versions a trajectory may lag the trainer "
                               "(admission and trainer)")
    max_inflight_sessions: int = Field(64, ge=1, description="admission limit on open sessions")
    backlog_groups: int = Field(8, ge=1, description="tasks kept waiting in TASKS beyond those running")
    max_ahead_steps: float | None = Field(
        3.0, gt=0, description="async: new groups are handed out only while the samples ahead of the "
        "trainer (those it could train now, and those of the groups in TASKS) are fewer than this many "
        "steps' worth. Rollouts faster than the trainer otherwise fill the stream up to "
        "`max_staleness`, and every step trains on samples that many versions old. None: no bound")
    tool_latency: ToolLatencyConfig = Field(default_factory=ToolLatencyConfig)
    tool_runtime: Literal["sandbox", "in_process"] = Field(
        "in_process", description="in_process: the calc tool (a pure function) runs in the rollout worker, "
        "with no sandbox per episode; sandbox: a fresh sandbox per episode and a sandboxed process per call")
    tool_call_format: Literal["tags", "hermes", "llama3_json", "mistral"] = Field(
        "tags", description="how the policy writes tool calls (rlfleet.common.tool_calls); the calc suite's "
        "prompts and demonstrations use tags")
    observation_framing: Literal["chatml", "template"] = Field(
        "chatml", description="chatml: tool results framed as ChatML by the worker (the default model); "
        "template: sent as chat messages the session server frames with the model's own "
        "template (any other family)")


class EvalConfig(StrictModel):
    heldout: int = Field(200, ge=1, description="held-out tasks per evaluation")
    regression: int = Field(50, ge=0, description="fixed regression tasks per evaluation")
    temperature: float = Field(1.0, ge=0, description="sampling temperature of evaluation episodes")
    concurrency: int = Field(64, ge=1, description="evaluation episodes at once")
    seeded: bool = Field(True, description="each evaluation task samples with its own fixed seed (from "
                         "the evaluation seed and its task ID), the same for every version: the gate "
                         "compares weights, not draws, and the accepted version's per-task results can be "
                         "kept instead of run again")
    seed: int | None = Field(
        None, ge=0, description="the evaluation seed of a seeded run; None (default): one drawn when the "
        "run starts and kept in its state across resumes. Every version of a run is evaluated on the "
        "same draws, so a run's held-out levels all share those draws' luck (the gate's comparisons "
        "do not: they are paired); a seed of its own per run keeps that luck from being the same in "
        "every run. Set it to repeat a run's evaluation draws exactly")


class EnginePools(StrictModel):
    """CPU engines of the run: the canary pool serves rollouts on the newest version, the candidate
    pool the version the promotion gate evaluates (pinned there while it does), the fleet the
    accepted one. Two or more in a pool: an engine that dies has its requests carried on by another
    of its pool at the same version while it restarts."""

    canary: int = Field(1, ge=1, le=8, description="engines of the canary pool (rollouts)")
    candidate: int = Field(
        1, ge=0, le=8, description="engines of the candidate pool (the gate's evaluations; async mode with a "
        "gate and full-weight training only). 0: the gate evaluates its candidate on the canary pool, "
        "which then moves only every gate.every_versions versions, so rollouts come from a policy up to "
        "that many versions old")
    fleet: int = Field(1, ge=1, le=8, description="engines of the fleet pool (the accepted version)")


class BudgetConfig(StrictModel):
    max_steps: int = Field(40, ge=1, description="stop after this many trainer steps")
    max_minutes: float = Field(10.0, gt=0,
                               description="stop the loop after this long (warm start not counted)")


class RunConfig(ServiceSections):
    """`rlfleet run`: warm start, baseline, then the RL loop with a promotion gate, and a report."""

    run_id: str = Field("calc", pattern=r"^[A-Za-z0-9_-]{1,64}$", description="run namespace")
    run_dir: str = Field("", description="run directory; empty = runs/<run_id>")
    mode: Literal["async", "sync"] = Field("async",
                                           description="async (overlapped) or sync (lock-step, on-policy)")
    seed: int = Field(0, ge=0, description="seed of task order and sampling")
    suite: Literal["calc", "repo"] = Field("calc", description="task suite: calc (the calculator agent) or "
                                         "repo (fix or write code in a small repository; its tools need "
                                         "rollout.tool_runtime = \"sandbox\")")
    difficulty: int = Field(1, ge=1, le=3, description="calc difficulty, or repo level (1 fix, 2 fix one "
                            "import away, 3 implement)")
    group_size: int = Field(8, ge=2, description="samples per task (G)")
    system_prompt: bool = Field(False, description="put the suite's system prompt in front of every task")
    model: ModelSpec = Field(default_factory=ModelSpec)
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    gate: GateConfig = Field(default_factory=GateConfig)
    audit: AuditConfig = Field(default_factory=AuditConfig)
    long_tail: LongTailConfig = Field(default_factory=LongTailConfig)
    budget: BudgetConfig = Field(default_factory=BudgetConfig)
    engines: EnginePools = Field(default_factory=EnginePools)
    restart: RestartPolicy = Field(default_factory=RestartPolicy,
                                   description="a platform process that dies is started "
                                   "again and the run goes on")
    model_cache_dir: str = Field("", description="base policies are cached here; empty = runs/.cache")
    start_timeout_s: float = Field(60.0, gt=0, description="give up on a platform process not healthy by "
                                   "then (a loaded machine may need more)")

    @model_validator(mode="before")
    @classmethod
    def _run_defaults(cls, data: Any) -> Any:
        return merge(RUN_DEFAULTS, data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _hand_down(self) -> RunConfig:
        shared: dict[str, dict[str, Any]] = {name: {"run_id": self.run_id} for name in self.sections()
                                             if name != "engine"}
        shared["trainer"].update(group_size=self.group_size, max_staleness=self.rollout.max_staleness,
                                 backend={"seed": self.seed})
        shared["gateway"].update(max_inflight_sessions=self.rollout.max_inflight_sessions)
        for name, values in shared.items():
            propagate(getattr(self, name), values, shared=True, where=name)
        gate = self.gate
        # Without candidate engines the canary holds the candidate while the gate evaluates it, so it
        # moves only every `every_versions` versions. The candidate pool moves that far at once
        # either way: the delta chain must reach it, or each move would be a full reload.
        sync = {"every_n_versions": gate.every_versions if self.canary_holds_candidates else 1,
                "max_delta_chain": max(4, gate.every_versions)}
        propagate(self.broker, {"auto_promote": not gate.enabled, "sync": sync}, where="broker")
        propagate(self.gateway, {"route_pools": ["canary"]}, where="gateway")  # rollouts go to the canary
        if self.trainer.backend.name == "torch":
            # bf16 autocast: the CPU trainer's matmuls on AMX, ~1.5x a step (bench/trainer_step.py);
            # Megatron's `bf16` means bf16 parameters, a different choice, left to its section.
            propagate(self.trainer.backend, {"bf16": True}, where="trainer.backend")
        if self.rollout.tool_runtime == "sandbox":
            # Every running episode holds a sandbox, and each verification of a unit-tests task takes one
            # more for a moment: a warm pool that covers the concurrency keeps creates off the critical path
            # (bench/code_episodes.py measures it).
            propagate(self.sandbox.driver, {"pool_size": self.rollout.concurrency + 2},
                      where="sandbox.driver")
        return self

    @property
    def canary_holds_candidates(self) -> bool:
        """An async run with a gate and no candidate engines evaluates its candidates on the canary."""
        return self.mode == "async" and self.gate.enabled and not self.candidate_engines

    @property
    def candidate_engines(self) -> int:
        """The candidate pool's engines the launch starts: only an async run with a gate evaluates
        beside its rollouts, and LoRA candidates are adapters served beside the accepted one on
        every engine (rlfleet.common.adapter_routes), with no pool of their own."""
        if self.mode != "async" or not self.gate.enabled or self.trainer.lora.enabled:
            return 0
        return self.engines.candidate

    @model_validator(mode="after")
    def _tools_can_run(self) -> RunConfig:
        if self.suite == "repo" and self.rollout.tool_runtime != "sandbox":
            raise ValueError('the repo suite runs model-written code: set rollout.tool_runtime = "sandbox"')
        return self

    @model_validator(mode="after")
    def _staleness_covers_the_gate(self) -> RunConfig:
        # With a gate and no candidate engines, the canary (rollout) engines get a version every
        # `every_versions`; rollouts of an older one must still be trainable, or the loop would starve
        # between syncs.
        if self.canary_holds_candidates and self.rollout.max_staleness < self.gate.every_versions:
            raise ValueError(f"rollout.max_staleness ({self.rollout.max_staleness}) must be at least "
                             f"gate.every_versions ({self.gate.every_versions})")
        return self
