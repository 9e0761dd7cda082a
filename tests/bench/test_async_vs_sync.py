"""The pure parts of bench/async_vs_sync.py: the per-mode configs it writes and the figures it reads."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("async_vs_sync", ROOT / "bench" / "async_vs_sync.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def _args(**kw):
    defaults = dict(median_s=0.3, sigma=1.0, max_s=10.0, heldout=100, eval_every=5, steps=30,
                    max_minutes=25.0, concurrency=0)
    return SimpleNamespace(**(defaults | kw))


def test_both_modes_get_the_same_workload_and_only_the_mode_differs(tmp_path):
    from rlfleet.cli.run_config import RunConfig

    base = tomllib.loads((ROOT / "examples" / "calc.toml").read_text())
    configs = {}
    for mode in ("async", "sync"):
        path = tmp_path / f"{mode}.toml"
        path.write_text(bench.to_toml(bench.mode_config(base, mode, _args(), tmp_path)))
        configs[mode] = RunConfig.model_validate(tomllib.loads(path.read_text())).model_dump()
    a, s = configs["async"], configs["sync"]
    assert a["mode"] == "async" and s["mode"] == "sync"
    for key in ("model", "warm_start", "trainer", "eval", "gate", "budget", "group_size", "rollout"):
        assert without_run_id(a[key]) == without_run_id(s[key]), key
    assert a["rollout"]["tool_latency"] == {"distribution": "lognormal", "median_s": 0.3, "sigma": 1.0,
                                            "max_s": 10.0}
    assert a["budget"]["max_steps"] == 30 and a["eval"]["regression"] == 0


def without_run_id(value):
    """A service section carries the run's id (each mode runs under its own), the rest is the workload."""
    return {k: v for k, v in value.items() if k != "run_id"} if isinstance(value, dict) else value


def test_time_to_target_is_the_first_evaluation_reaching_it():
    curve = [{"elapsed_s": 0.0, "success": 0.3, "label": "baseline", "version": 0},
             {"elapsed_s": 50.0, "success": 0.42, "label": "candidate", "version": 5},
             {"elapsed_s": 90.0, "success": 0.5, "label": "candidate", "version": 10},
             {"elapsed_s": 95.0, "success": 0.49, "label": "final", "version": 10}]
    assert bench.time_to(curve, 0.45) == 90.0
    assert bench.time_to(curve, 0.6) is None


def test_figures_come_from_the_summary():
    summary = {"steps": 30, "wall_s": 200.0, "trajectories": {"per_second": 9.5},
               "trained_tokens_per_s": 700.0,
               "trainer_idle_fraction": 0.08, "gate_wait_s": 0.0, "staleness": {"max": 5},
               "tool_wait_s": {"p50": 0.4, "p99": 6.0}, "peak_rss_mb": 2100.0,
               "baseline_vs_rl": {"baseline": {"task_success": 0.3}, "rl_accepted": {"task_success": 0.55}},
               "heldout_curve": [{"elapsed_s": 0.0, "success": 0.6, "label": "baseline", "version": 0},
                                 {"elapsed_s": 120.0, "success": 0.5, "label": "candidate", "version": 5}]}
    got = bench.figures(summary, 0.45)
    assert got["time_to_target_s"] == 120.0  # the baseline's own evaluation never counts
    assert got["trajectories_per_s"] == pytest.approx(9.5) and got["final_success"] == 0.55
