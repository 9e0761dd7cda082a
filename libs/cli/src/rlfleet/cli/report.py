"""The run report: `summary.json`, PNG plots and one HTML page in the run directory.

Everything is computed from the run's record (`RunRecord`), which the loop fills from what the
platform itself publishes: the TRAJECTORIES audit log, the POLICY announcements, evaluations, the
gate's decisions, the trainer's and broker's status, and CPU samples.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class TaskOutcome:
    """One task's episode in an evaluation: what the gate pairs by task ID."""

    task_id: str
    passed: bool
    invalid_tool_calls: int
    safety_violations: int
    time_s: float


@dataclass
class EvalResult:
    version: int
    split: str              # heldout | regression
    episodes: int
    success: float          # share of episodes the verifier passed
    invalid_tool_calls: float  # per episode
    safety_violations: float   # per episode
    time_to_completion_s: float  # mean episode wall time
    interactions: float     # mean generate turns per episode
    elapsed_s: float        # since the loop started
    label: str = ""         # baseline | candidate | accepted | final
    tasks: list[TaskOutcome] = field(default_factory=list)  # per task, in task order (the gate pairs them)
    retried: int = 0        # episodes run again because a service outage stopped them

    def __post_init__(self) -> None:
        self.tasks = [TaskOutcome(**t) if isinstance(t, dict) else t for t in self.tasks]


@dataclass
class GateDecision:
    version: int
    accepted: bool
    reasons: list[str]
    elapsed_s: float
    checks: list[dict[str, Any]] = field(default_factory=list)  # each test with its interval (gate.Check)
    tasks: int = 0          # paired tasks the decision rests on
    early: bool = False     # refused at an interim look, before the whole held-out set was run


@dataclass
class StepRecord:
    step: int
    version: int
    elapsed_s: float
    reward_mean: float
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class TrajectoryRecord:
    elapsed_s: float
    length: int
    generated: int
    reward: float
    passed: bool
    status: str
    split: str
    min_version: int
    staleness: int          # newest announced version at receipt - oldest generated span's version
    tool_wait_s: float
    generate_latencies_s: list[float]


@dataclass
class EpisodeRecord:
    """One training episode as the driver's rollout worker saw it: where its time went, its tools, its
    verdict."""

    elapsed_s: float
    passed: bool
    reasons: list[str]      # the verdict's reason codes, empty for a clean pass
    tools: dict[str, int]   # tool calls run, by tool
    invalid_calls: int
    generate_s: float
    tool_s: float           # tool calls (each a sandboxed process with the sandbox runtime)
    sandbox_s: float        # creating, setting up and destroying the sandbox
    verify_s: float         # the verifier's call, hidden tests included
    episode_s: float


@dataclass
class RunRecord:
    run_id: str
    mode: str
    config: dict[str, Any]
    started_unix: float
    wall_s: float = 0.0
    steps: list[StepRecord] = field(default_factory=list)
    evals: list[EvalResult] = field(default_factory=list)
    gate: list[GateDecision] = field(default_factory=list)
    trajectories: list[TrajectoryRecord] = field(default_factory=list)
    weight_pauses_s: list[float] = field(default_factory=list)
    cpu: list[tuple[float, float]] = field(default_factory=list)  # (elapsed_s, percent of all cores)
    memory_mb: list[tuple[float, float]] = field(default_factory=list)  # (elapsed_s, RSS of all processes)
    trainer_idle_fraction: float = 0.0
    accepted_version: int = 0
    status: str = "running"  # running | finished | interrupted
    gate_wait_s: float = 0.0  # loop time the rollouts stood still for the gate (sync mode only)
    trainer_wait_s: float = 0.0     # the trainer's data-wait time during the loop
    trainer_watched_s: float = 0.0  # loop time over which trainer_wait_s was measured
    notes: list[str] = field(default_factory=list)
    audits: list[dict[str, Any]] = field(default_factory=list)  # verifier audits (stop_rules.AuditResult)
    long_tail: dict[str, Any] = field(default_factory=dict)    # the last long-tail account (stop_rules)
    stop_rule: str = ""     # the stop rule that ended the run, or that fired when set to report only
    episodes: list[EpisodeRecord] = field(default_factory=list)  # training episodes of the driver's worker


def percentiles(values: list[float], points=(50, 90, 99)) -> dict[str, float]:
    if not values:
        return {f"p{p}": 0.0 for p in points}
    ordered = sorted(values)
    return {f"p{p}": ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] for p in points}


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _eval_of(record: RunRecord, label: str, split: str = "heldout") -> EvalResult | None:
    found = [e for e in record.evals if e.label == label and e.split == split]
    return found[-1] if found else None


REASON_BUCKET_S = 60.0


def episode_figures(episodes: list[EpisodeRecord]) -> dict[str, Any]:
    """Tool calls by tool, sandbox time per episode, time per phase, and the verifier's failure
    reasons per minute of loop time (empty without episodes: a run whose worker recorded none)."""
    if not episodes:
        return {}
    n = len(episodes)
    by_tool: dict[str, int] = {}
    for episode in episodes:
        for tool, count in episode.tools.items():
            by_tool[tool] = by_tool.get(tool, 0) + count
    buckets: dict[int, dict[str, Any]] = {}
    for episode in episodes:
        bucket = buckets.setdefault(int(episode.elapsed_s // REASON_BUCKET_S),
                                    {"episodes": 0, "passed": 0, "reasons": {}})
        bucket["episodes"] += 1
        bucket["passed"] += episode.passed
        for reason in dict.fromkeys(episode.reasons):  # an episode counts once per reason
            bucket["reasons"][reason] = bucket["reasons"].get(reason, 0) + 1
    return {
        "episodes": n,
        "tool_calls_by_tool": dict(sorted(by_tool.items())),
        "tool_calls_per_episode": {tool: count / n for tool, count in sorted(by_tool.items())},
        "invalid_tool_calls_per_episode": sum(e.invalid_calls for e in episodes) / n,
        "sandbox_s_per_episode": percentiles([e.sandbox_s + e.tool_s for e in episodes]) | {
            "mean": _mean([e.sandbox_s + e.tool_s for e in episodes])},
        "phase_s_per_episode": {"sandbox_create_destroy": _mean([e.sandbox_s for e in episodes]),
                                "tool_execs": _mean([e.tool_s for e in episodes]),
                                "generation": _mean([e.generate_s for e in episodes]),
                                "verification": _mean([e.verify_s for e in episodes]),
                                "episode": _mean([e.episode_s for e in episodes])},
        "verifier_reasons_over_time": [{"from_s": k * REASON_BUCKET_S, **v}
                                       for k, v in sorted(buckets.items())],
    }


def summarize(record: RunRecord) -> dict[str, Any]:
    train = [t for t in record.trajectories if t.split == "train"]
    latencies = [lat for t in train for lat in t.generate_latencies_s]
    baseline, final = _eval_of(record, "baseline"), _eval_of(record, "final")
    comparison = {}
    for name, result in (("baseline", baseline), ("rl_accepted", final)):
        if result is not None:
            comparison[name] = {"version": result.version, "task_success": result.success,
                                "invalid_tool_calls_per_episode": result.invalid_tool_calls,
                                "time_to_completion_s": result.time_to_completion_s,
                                "interactions_per_episode": result.interactions,
                                "safety_violations_per_episode": result.safety_violations,
                                "episodes": result.episodes}
    staleness = [t.staleness for t in train]
    wall = record.wall_s or 0.0
    return {
        "run_id": record.run_id, "mode": record.mode, "status": record.status, "wall_s": round(wall, 1),
        "steps": len(record.steps), "final_version": record.steps[-1].version if record.steps else 0,
        "accepted_version": record.accepted_version,
        "baseline_vs_rl": comparison,
        "heldout_success_gain": (final.success - baseline.success) if baseline and final else None,
        "trajectories": {"train": len(train), "all": len(record.trajectories),
                         # what arrived within the loop: groups finishing while the workers drain don't count
                         "per_second": sum(t.elapsed_s <= wall for t in train) / wall if wall else 0.0,
                         "length": percentiles([t.length for t in train]),
                         "reward_mean": _mean([t.reward for t in train])},
        "rollout_latency_s": percentiles(latencies),
        "tool_wait_s": percentiles([t.tool_wait_s for t in train]),
        # At receipt (how far the engines lag the trainer) and at training (plus the wait on the stream).
        "staleness": {"max": max(staleness, default=0), "mean": _mean(staleness),
                      "histogram": {str(k): staleness.count(k) for k in sorted(set(staleness))},
                      "trained": trained_staleness(record.steps)},
        "weight_update_pause_s": percentiles(record.weight_pauses_s) | {"count": len(record.weight_pauses_s)},
        "trainer_idle_fraction": record.trainer_idle_fraction,
        "trained_tokens_per_s": (sum(s.metrics.get("tokens", 0.0) for s in record.steps) / wall
                                 if wall else 0.0),
        "heldout_curve": [{"elapsed_s": round(e.elapsed_s, 1), "version": e.version, "success": e.success,
                           "label": e.label} for e in record.evals if e.split == "heldout"],
        "gate_wait_s": round(record.gate_wait_s, 1),
        "cpu_percent_mean": _mean([c for _, c in record.cpu]),
        "peak_rss_mb": round(max((m for _, m in record.memory_mb), default=0.0), 1),
        "gate": [asdict(d) for d in record.gate],
        "verifier_audits": record.audits,
        "long_tail": record.long_tail,
        "stop_rule": record.stop_rule,
        "notes": record.notes,
        "episodes": episode_figures(record.episodes),
    }


def trained_staleness(steps) -> dict[str, float]:
    """Versions between the policy that generated a trained sample and the step that trained it: the
    mean over every sample of the run's steps, and the largest."""
    samples = sum(s.metrics.get("samples", 0.0) for s in steps)
    mean = (sum(s.metrics.get("staleness_mean", 0.0) * s.metrics.get("samples", 0.0) for s in steps) / samples
            if samples else 0.0)
    largest = max((s.metrics.get("staleness_max", 0.0) for s in steps), default=0.0)
    return {"mean": round(mean, 3), "max": largest}


def _plots(record: RunRecord, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
        made.append(name)

    fig, ax = plt.subplots(figsize=(7, 3.5))
    if record.steps:
        ax.plot([s.elapsed_s for s in record.steps], [s.reward_mean for s in record.steps],
                label="train reward (batch mean)")
    held = [e for e in record.evals if e.split == "heldout"]
    if held:
        ax.plot([e.elapsed_s for e in held], [e.success for e in held], "o-", label="held-out success")
    base = _eval_of(record, "baseline")
    if base:
        ax.axhline(base.success, color="grey", ls="--", label="baseline (SFT) held-out")
    ax.set_xlabel("seconds since the loop started")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("Reward and held-out success")
    save(fig, "reward_success.png")

    train = [t for t in record.trajectories if t.split == "train"]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    lat = [x for t in train for x in t.generate_latencies_s]
    axes[0].hist(lat or [0], bins=30)
    axes[0].set_title("rollout latency per turn (s)")
    axes[1].hist([t.tool_wait_s for t in train] or [0], bins=30)
    axes[1].set_title("tool wait per episode (s)")
    axes[2].hist([t.length for t in train] or [0], bins=30)
    axes[2].set_title("trajectory length (tokens)")
    save(fig, "rollout.png")

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    staleness = [t.staleness for t in train]
    if staleness:
        axes[0].hist(staleness, bins=range(0, max(staleness) + 2), align="left", rwidth=0.8)
    axes[0].set_title("staleness (versions)")
    axes[1].plot([t.elapsed_s for t in train], [t.min_version for t in train], ".", ms=2)
    axes[1].set_title("policy version of trajectories")
    axes[2].hist(record.weight_pauses_s or [0], bins=20)
    axes[2].set_title("weight-update pause (s)")
    save(fig, "versions.png")

    if record.cpu:
        fig, ax = plt.subplots(figsize=(7, 2.8))
        ax.plot([c[0] for c in record.cpu], [c[1] for c in record.cpu])
        ax.set_ylim(0, 105)
        ax.set_title("CPU use of the platform (% of all cores)")
        ax.set_xlabel("seconds")
        save(fig, "cpu.png")
    return made


def _table(rows: list[list[str]]) -> str:
    head, *body = rows
    cells = "".join(f"<th>{html.escape(c)}</th>" for c in head)
    lines = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in body)
    return f"<table><tr>{cells}</tr>{lines}</table>"


def _episode_tables(figures: dict[str, Any]) -> str:
    if not figures:
        return ""
    tools = [["tool", "calls", "per episode"]] + [
        [tool, str(count), f"{figures['tool_calls_per_episode'][tool]:.2f}"]
        for tool, count in figures["tool_calls_by_tool"].items()]
    phases = [["phase", "mean s per episode"]] + [
        [k, f"{v:.3f}"] for k, v in figures["phase_s_per_episode"].items()]
    reasons = [["from (s)", "episodes", "passed", "failure reasons"]] + [
        [f"{b['from_s']:.0f}", str(b["episodes"]), str(b["passed"]),
         ", ".join(f"{k} {v}" for k, v in sorted(b["reasons"].items())) or "-"]
        for b in figures["verifier_reasons_over_time"]]
    return (f"<h2>Tool calls</h2>{_table(tools)}<h2>Time per episode by phase</h2>{_table(phases)}"
            f"<h2>Verifier failure reasons over time</h2>{_table(reasons)}")


PAGE_STYLE = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto}"
              "table{border-collapse:collapse;margin:1em 0}\n"
              "td,th{border:1px solid #ccc;padding:4px 10px;text-align:left}img{max-width:100%}")


def write_report(record: RunRecord, run_dir: Path) -> dict[str, Any]:
    out = run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(record)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "record.json").write_text(json.dumps(asdict(record), default=str))
    plots = _plots(record, out)
    comparison = summary["baseline_vs_rl"]
    rows = [["metric", *comparison]]
    for metric in ("task_success", "invalid_tool_calls_per_episode", "time_to_completion_s",
                   "interactions_per_episode", "safety_violations_per_episode", "version", "episodes"):
        rows.append([metric, *(f"{comparison[k][metric]:.3g}" for k in comparison)])
    gate_rows = [["version", "accepted", "reasons"]] + [
        [str(d["version"]), "yes" if d["accepted"] else "no", "; ".join(d["reasons"])]
        for d in summary["gate"]]
    stats = [["figure", "value"],
             ["trajectories/s (train)", f"{summary['trajectories']['per_second']:.2f}"],
             ["rollout latency p50/p99 (s)",
              f"{summary['rollout_latency_s']['p50']:.3f} / {summary['rollout_latency_s']['p99']:.3f}"],
             ["tool wait p50/p99 (s)",
              f"{summary['tool_wait_s']['p50']:.3f} / {summary['tool_wait_s']['p99']:.3f}"],
             ["staleness at receipt max / mean",
              f"{summary['staleness']['max']} / {summary['staleness']['mean']:.2f}"],
             ["staleness at training max / mean", f"{summary['staleness']['trained']['max']:.0f} / "
                                                  f"{summary['staleness']['trained']['mean']:.2f}"],
             ["weight-update pause p50/p99 (s)", f"{summary['weight_update_pause_s']['p50']:.4f} / "
                                                 f"{summary['weight_update_pause_s']['p99']:.4f}"],
             ["trainer idle fraction", f"{summary['trainer_idle_fraction']:.2f}"],
             ["CPU use (mean % of cores)", f"{summary['cpu_percent_mean']:.0f}"],
             ["wall time (s)", f"{summary['wall_s']:.0f}"]]
    run_id = html.escape(record.run_id)
    plot_html = "".join(f'<h2>{html.escape(p.removesuffix(".png").replace("_", " "))}</h2>'
                        f'<img src="report/{p}">' for p in plots)
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>rlfleet run {run_id}</title>
<style>{PAGE_STYLE}</style></head><body>
<h1>rlfleet run <code>{run_id}</code> ({html.escape(record.mode)})</h1>
<h2>Baseline vs RL (held-out split)</h2>{_table(rows)}
<h2>Loop</h2>{_table(stats)}
<h2>Promotion gate</h2>{_table(gate_rows)}
{_episode_tables(summary["episodes"])}
{plot_html}
<h2>Notes</h2><ul>{''.join(f'<li>{html.escape(n)}</li>' for n in record.notes)}</ul>
</body></html>"""
    (run_dir / "report.html").write_text(page)
    return summary


def summary_lines(summary: dict) -> list[str]:
    """The run's end on screen: held-out success before and after, the gate's decisions, the audits,
    the stop rule, the episodes' tools, phases and failure reasons."""
    lines: list[str] = []
    say = lines.append
    rows = summary["baseline_vs_rl"]
    say("")
    say(f"run {summary['run_id']} ({summary['mode']}): {summary['steps']} steps in "
        f"{summary['wall_s']:.0f} s, accepted version {summary['accepted_version']}")
    for name, row in rows.items():
        say(f"  {name:12s} held-out success {row['task_success']:.3f}  invalid tool calls/ep "
            f"{row['invalid_tool_calls_per_episode']:.3f}  time {row['time_to_completion_s']:.2f} s  "
            f"turns {row['interactions_per_episode']:.2f}  "
            f"safety {row['safety_violations_per_episode']:.3f}")
    for d in summary["gate"]:
        success = next((c for c in d.get("checks", []) if c["name"] == "held-out success"), None)
        interval = (f" gain {success['estimate']:+.3f} [{success['low']:+.3f}, {success['high']:+.3f}]"
                    if success else "")
        refused = [c["name"] for c in d.get("checks", []) if not c["passed"]]
        say(f"  gate v{d['version']:<4d} {'accepted' if d['accepted'] else 'refused '} "
            f"on {d.get('tasks', 0)} paired tasks{' (early)' if d.get('early') else ''}:{interval}"
            + (f"  refused by: {', '.join(refused)}" if refused else ""))
    for audit in summary["verifier_audits"]:
        say(f"  verifier audit ({audit['when']}): n {audit['n']}  "
            f"FP rate {audit['false_positive_rate']:.3f}  FN rate {audit['false_negative_rate']:.3f}")
    if summary["long_tail"]:
        say(f"  long tail: {summary['long_tail']['message']}")
    if summary["stop_rule"]:
        say(f"  stop rule: {summary['stop_rule']}")
    episodes = summary.get("episodes") or {}
    if episodes:
        tools = ", ".join(f"{t} {n:.2f}" for t, n in episodes["tool_calls_per_episode"].items())
        phases = episodes["phase_s_per_episode"]
        say(f"  tool calls per episode ({episodes['episodes']} training episodes): "
            f"{tools or 'none'}")
        say(f"  time per episode: sandbox create+destroy {phases['sandbox_create_destroy']:.2f} s, "
            f"tool execs {phases['tool_execs']:.2f} s, generation {phases['generation']:.2f} s, "
            f"verification {phases['verification']:.2f} s "
            f"(sandbox time p50 {episodes['sandbox_s_per_episode']['p50']:.2f} s)")
        for bucket in episodes["verifier_reasons_over_time"]:
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(bucket["reasons"].items())) or "none"
            say(f"  [{bucket['from_s']:5.0f}s] {bucket['passed']}/{bucket['episodes']} passed; "
                f"failure reasons: {reasons}")
    return lines
