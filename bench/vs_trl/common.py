"""The pure parts of the TRL comparison: shared settings, workloads, rlfleet configs, results, figures.

Nothing here imports torch, TRL or the platform, so the unit tests run in a blink.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from rlfleet.common.config import StrictModel

SYSTEMS = ("trl", "sync", "async")
WORKLOADS = ("plain", "slow")


class Settings(StrictModel):
    """What all three systems share: task, model, GRPO settings, evaluation, budget."""

    seed: int = 0
    difficulty: int = Field(1, ge=1, le=3)
    group_size: int = Field(8, ge=2, description="G, samples per task")
    groups_per_step: int = Field(8, ge=1, description="groups per optimizer step")
    lr: float = Field(5e-5, gt=0)
    temperature: float = Field(1.0, ge=0, description="sampling temperature of training rollouts")
    eval_temperature: float = Field(1.0, ge=0, description="sampling temperature of held-out episodes")
    heldout: int = Field(100, ge=1, description="held-out tasks per evaluation")
    eval_every_steps: int = Field(5, ge=1, description="held-out evaluation every this many versions")
    budget_s: float = Field(120.0, gt=0, description="training wall budget per run")
    max_completion_tokens: int = Field(256, ge=16, description="TRL: tokens of a whole multi-turn completion "
                                       "(rlfleet: the calc task's per-turn limit and the session budget)")
    max_staleness: int = Field(6, ge=0, description="rlfleet async: staleness bound (>= eval_every_steps)")
    concurrency: int = Field(32, ge=1, description="rlfleet: episodes at once")
    bf16: bool = Field(True, description="train in bf16 autocast, weights and optimizer fp32 (TRL: "
                       "bf16=True, which autocasts its generation too; rlfleet: trainer.backend.bf16, its "
                       "engines compute in fp32); false: both fp32")


class Workload(StrictModel):
    name: str
    distribution: Literal["none", "constant", "lognormal"] = "none"
    median_s: float = 0.5
    sigma: float = 1.0
    max_s: float = 20.0

    def tool_latency(self) -> dict[str, Any]:
        return {"distribution": self.distribution, "median_s": self.median_s, "sigma": self.sigma,
                "max_s": self.max_s}

    def describe(self) -> str:
        if self.distribution == "none":
            return "plain calc task (no added tool latency)"
        if self.distribution == "constant":
            return f"calc task, every tool call +{self.median_s:g} s"
        return (f"calc task, tool latency lognormal(median {self.median_s:g} s, sigma {self.sigma:g}, "
                f"cap {self.max_s:g} s), mean {lognormal_mean(self.median_s, self.sigma, self.max_s):.2f} s")


def lognormal_mean(median_s: float, sigma: float, cap_s: float) -> float:
    """Mean of min(LogNormal(ln median, sigma), cap) (the cap barely matters for the usual settings)."""
    mu = math.log(max(median_s, 1e-9))
    if cap_s <= 0:
        return 0.0
    # E[min(X, c)] = E[X; X < c] + c P(X >= c)
    z = (math.log(cap_s) - mu) / sigma if sigma > 0 else math.inf
    phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    if sigma == 0:
        return min(median_s, cap_s)
    return math.exp(mu + sigma**2 / 2) * phi(z - sigma) + cap_s * (1 - phi(z))


def workloads(slow_median_s: float = 0.5, slow_sigma: float = 1.0,
              slow_max_s: float = 20.0) -> dict[str, Workload]:
    return {"plain": Workload(name="plain"),
            "slow": Workload(name="slow", distribution="lognormal", median_s=slow_median_s, sigma=slow_sigma,
                             max_s=slow_max_s)}


class TrlJob(StrictModel):
    """What `trl_grpo.py` is given."""

    settings: Settings
    tool_latency: dict[str, Any]
    policy_dir: str
    work_dir: Path
    torch_threads: int = 2


# ---------------------------------------------------------------------------------------------
# rlfleet configs


def rlfleet_config(settings: Settings, workload: Workload, mode: str, run_id: str, run_dir: Path,
                   model_cache_dir: Path, trainer_threads: int = 1) -> dict[str, Any]:
    """The `rlfleet run` config of one system and workload, as a dict (see `to_toml`). Warm start and
    model are the defaults (those of examples/calc.toml), so every run shares one cached base policy."""
    if mode not in ("sync", "async"):
        raise ValueError(f"mode must be sync or async, not {mode!r}")
    return {
        "run_id": run_id, "run_dir": str(run_dir), "mode": mode, "seed": settings.seed,
        "difficulty": settings.difficulty, "group_size": settings.group_size, "system_prompt": False,
        "model_cache_dir": str(model_cache_dir),
        "rollout": {"concurrency": settings.concurrency, "temperature": settings.temperature,
                    "max_staleness": max(settings.max_staleness, settings.eval_every_steps),
                    "tool_latency": workload.tool_latency()},
        "trainer": {"loss": {"algorithm": "grpo"}, "optim": {"lr": settings.lr},
                    "groups_per_step": settings.groups_per_step, "torch_threads": trainer_threads,
                    "backend": {"bf16": settings.bf16}},
        "eval": {"heldout": settings.heldout, "regression": 0, "temperature": settings.eval_temperature},
        "gate": {"every_versions": settings.eval_every_steps},
        "budget": {"max_steps": 100_000, "max_minutes": settings.budget_s / 60.0},
    }


def to_toml(config: dict[str, Any]) -> str:
    """A TOML rendering of a config of scalars and tables (all this bench writes)."""
    lines: list[str] = []
    _toml_table(config, [], lines)
    return "\n".join(lines).strip() + "\n"


def _toml_table(table: dict[str, Any], path: list[str], lines: list[str]) -> None:
    scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in table.items() if isinstance(v, dict)}
    if path and scalars:
        lines.append(f"[{'.'.join(path)}]")
    for key, value in scalars.items():
        lines.append(f"{key} = {_toml_value(value)}")
    if scalars:
        lines.append("")
    for key, value in tables.items():
        _toml_table(value, [*path, key], lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


# ---------------------------------------------------------------------------------------------
# Results


class SystemResult(StrictModel):
    """One system on one workload, whatever produced it."""

    system: str
    workload: str
    wall_s: float
    completions_per_s: float
    trained_tokens_per_s: float
    trainer_idle_fraction: float | None
    peak_rss_mb: float | None
    curve: list[dict[str, Any]]  # {elapsed_s, version, success, label}
    notes: list[str] = Field(default_factory=list)
    raw: dict[str, Any] = Field(default_factory=dict)

    @property
    def baseline(self) -> float | None:
        points = [p for p in self.curve if p.get("label") == "baseline"]
        return points[0]["success"] if points else None

    @property
    def best(self) -> float | None:
        return max((p["success"] for p in self.curve), default=None)

    @property
    def final(self) -> float | None:
        points = [p for p in self.curve if p.get("label") == "final"]
        return points[-1]["success"] if points else (self.curve[-1]["success"] if self.curve else None)


def from_rlfleet_summary(summary: dict[str, Any], system: str, workload: str) -> SystemResult:
    """A `runs/<id>/summary.json` of `rlfleet run` as a result row."""
    missing = [k for k in ("heldout_curve", "wall_s", "trained_tokens_per_s",
                           "trajectories") if k not in summary]
    if missing:
        raise KeyError(f"summary.json lacks {', '.join(missing)} (needs the loop's bench fields)")
    trajectories = summary["trajectories"]
    per_second = trajectories.get("per_second") if isinstance(trajectories, dict) else None
    if per_second is None:
        raise KeyError("summary.json lacks trajectories.per_second")
    curve = [{"elapsed_s": float(p["elapsed_s"]), "version": int(p.get("version", 0)),
              "success": float(p["success"]),
              "label": str(p.get("label", ""))} for p in summary["heldout_curve"]]
    return SystemResult(system=system, workload=workload, wall_s=float(summary["wall_s"]),
                        completions_per_s=float(per_second),
                        trained_tokens_per_s=float(summary["trained_tokens_per_s"]),
                        trainer_idle_fraction=_maybe_float(summary.get("trainer_idle_fraction")),
                        peak_rss_mb=_maybe_float(summary.get("peak_rss_mb")), curve=curve)


def from_trl_result(result: dict[str, Any], workload: str,
                    clock: Literal["train", "wall"] = "train") -> SystemResult:
    """TRL's result row. ``clock="train"``: times and rates on TRL's training clock, which stops while it
    evaluates (the default, in TRL's favour); ``"wall"``: on the wall clock, evaluations included."""
    if clock == "train":
        notes = [f"TRL clock excludes held-out evaluation ({result['eval_s']:.0f} s of evaluation; "
                 f"{result['wall_with_eval_s']:.0f} s wall with it)"]
        wall, key = float(result["wall_s"]), "elapsed_s"
    else:
        notes = [f"TRL clock includes its {result['eval_s']:.0f} s of held-out evaluation"]
        wall, key = float(result["wall_with_eval_s"]), "wall_s"
    scale = float(result["wall_s"]) / wall if wall else 0.0  # rates were measured on the training clock
    curve = [{"elapsed_s": p[key], "version": p["version"], "success": p["success"], "label": p["label"]}
             for p in result["heldout_curve"]]
    return SystemResult(system="trl", workload=workload, wall_s=wall,
                        completions_per_s=float(result["completions_per_s"]) * scale,
                        trained_tokens_per_s=float(result["trained_tokens_per_s"]) * scale,
                        trainer_idle_fraction=_maybe_float(result.get("trainer_idle_fraction")),
                        peak_rss_mb=_maybe_float(result.get("peak_rss_mb")), curve=curve,
                        notes=notes, raw=result)


def on_trl_clock(results: list[SystemResult], clock: Literal["train", "wall"]) -> list[SystemResult]:
    """The results with TRL's rows recomputed on `clock` from their raw figures (rlfleet's unchanged)."""
    return [from_trl_result(r.raw, r.workload, clock) if r.system == "trl" and r.raw else r for r in results]


def _maybe_float(value: Any) -> float | None:
    return None if value is None else float(value)


def time_to_target(curve: list[dict[str, Any]], target: float) -> float | None:
    """Elapsed seconds of the first held-out evaluation at or above ``target`` (None: never reached).
    The baseline counts too (a target the base policy already meets is reached at its time)."""
    for point in sorted(curve, key=lambda p: p["elapsed_s"]):
        if point["success"] >= target:
            return float(point["elapsed_s"])
    return None


def default_target(results: list[SystemResult], gain: float) -> float:
    """The mean baseline success over the runs (all start from the same weights) plus ``gain``."""
    baselines = [r.baseline for r in results if r.baseline is not None]
    if not baselines:
        raise ValueError("no run has a baseline evaluation to set the target from")
    return round(sum(baselines) / len(baselines) + gain, 3)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def ratios(results: list[SystemResult], target: float) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per workload: rlfleet-async / TRL and rlfleet-async / rlfleet-sync, for the throughputs and the
    speed-up in time to target (the other system's time / async's time, so > 1 means async is sooner)."""
    by = {(r.workload, r.system): r for r in results}
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for workload in sorted({r.workload for r in results}):
        fast = by.get((workload, "async"))
        if fast is None:
            continue
        rows = {}
        for other in ("trl", "sync"):
            slow = by.get((workload, other))
            if slow is None:
                continue
            fast_t, slow_t = time_to_target(fast.curve, target), time_to_target(slow.curve, target)
            rows[f"async/{other}"] = {
                "completions_per_s": ratio(fast.completions_per_s, slow.completions_per_s),
                "trained_tokens_per_s": ratio(fast.trained_tokens_per_s, slow.trained_tokens_per_s),
                "time_to_target_speedup": ratio(slow_t, fast_t),
                # the other system never got there within its wall time: async was at least this much sooner
                "time_to_target_speedup_at_least": ratio(slow.wall_s, fast_t) if slow_t is None else None,
                "final_success_gain": (None if fast.final is None or slow.final is None
                                       else fast.final - slow.final),
            }
        out[workload] = rows
    return out


def table(results: list[SystemResult], target: float) -> str:
    """The figures as a fixed-width table, one row per system and workload."""
    head = (f"{'workload':8s} {'system':6s} {'compl/s':>8s} {'tok/s':>8s} {'to target':>10s} "
            f"{'baseline':>8s} {'final':>6s} {'best':>6s} {'idle':>6s} {'peak MB':>8s} {'wall s':>7s}")
    lines = [head, "-" * len(head)]
    for r in sorted(results, key=lambda r: (WORKLOADS.index(r.workload) if r.workload in WORKLOADS else 9,
                                             SYSTEMS.index(r.system) if r.system in SYSTEMS else 9)):
        ttt = time_to_target(r.curve, target)
        lines.append(
            f"{r.workload:8s} {r.system:6s} {r.completions_per_s:8.2f} {r.trained_tokens_per_s:8.1f} "
            f"{_fmt(ttt, '{:9.0f}s', 'not reached'):>10s} {_fmt(r.baseline, '{:.3f}'):>8s} "
            f"{_fmt(r.final, '{:.3f}'):>6s} "
            f"{_fmt(r.best, '{:.3f}'):>6s} {_fmt(r.trainer_idle_fraction, '{:.0%}'):>6s} "
            f"{_fmt(r.peak_rss_mb, '{:.0f}'):>8s} {r.wall_s:7.0f}")
    return "\n".join(lines)


def ratio_lines(rat: dict[str, dict[str, dict[str, float | None]]]) -> str:
    lines = []
    for workload, rows in rat.items():
        for name, row in rows.items():
            lines.append(f"{workload:8s} rlfleet-{name.replace('/', ' / ')}:  "
                         f"completions/s x{_fmt(row['completions_per_s'], '{:.2f}')}"
                         f"  trained tokens/s x{_fmt(row['trained_tokens_per_s'], '{:.2f}')}"
                         f"  time to target {_speedup(row)}"
                         f"  final success {_fmt(row['final_success_gain'], '{:+.3f}')}")
    return "\n".join(lines)


def _speedup(row: dict[str, float | None]) -> str:
    speedup = row.get("time_to_target_speedup")
    if speedup is not None:
        # The aim is async's time over the other's; a speed-up under 1 is a slowdown, said so.
        if speedup >= 1:
            return f"x{speedup:.2f} sooner (async's time x{1 / speedup:.2f} the other's)"
        return f"x{1 / speedup:.2f} later"
    if row.get("time_to_target_speedup_at_least") is not None:
        return f"at least x{row['time_to_target_speedup_at_least']:.2f} sooner (the other never reached it)"
    return "- (async did not reach it)"


def _fmt(value: float | None, spec: str, missing: str = "-") -> str:
    return missing if value is None else spec.format(value)


def write_results(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str))


def plot(results: list[SystemResult], target: float, path: Path) -> Path:
    """Held-out success against wall time, one panel per workload, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [w for w in WORKLOADS
             if any(r.workload == w for r in results)] or sorted({r.workload for r in results})
    fig, axes = plt.subplots(1, len(names), figsize=(5.2 * len(names), 3.8), squeeze=False)
    colors = {"trl": "tab:orange", "sync": "tab:blue", "async": "tab:green"}
    for ax, workload in zip(axes[0], names, strict=True):
        for r in (r for r in results if r.workload == workload):
            points = sorted(r.curve, key=lambda p: p["elapsed_s"])
            label = {"trl": "TRL GRPOTrainer", "sync": "rlfleet sync",
                     "async": "rlfleet async"}.get(r.system, r.system)
            ax.plot([p["elapsed_s"] for p in points], [p["success"] for p in points], marker="o", ms=3,
                    label=label, color=colors.get(r.system))
        ax.axhline(target, color="grey", ls="--", lw=0.8, label=f"target {target:.2f}")
        ax.set_title(workload)
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("held-out success")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_rlfleet(config: dict[str, Any], name: str, out_dir: Path) -> dict:
    """`rlfleet run --fresh` on ``config`` (written to out_dir/NAME.toml, output to NAME.log); exits
    with the log's tail when the run fails, else returns its summary.json."""
    path = out_dir / f"{name}.toml"
    path.write_text(to_toml(config))
    log = out_dir / f"{name}.log"
    print(f"== {name}: rlfleet run {path} (log {log})", flush=True)
    rlfleet = str(Path(sys.executable).parent / "rlfleet")
    with open(log, "w") as out:
        code = subprocess.run([rlfleet, "run", str(path), "--fresh"], stdout=out,
                              stderr=subprocess.STDOUT).returncode
    if code != 0:
        sys.exit(f"{name} run failed (exit {code}); see {log}:\n"
                 + "\n".join(log.read_text().splitlines()[-20:]))
    return json.loads((Path(config["run_dir"]) / "summary.json").read_text())
