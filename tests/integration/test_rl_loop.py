"""The RL loop end to end on a tiny model: versions advance, trajectories flow, staleness stays
bounded, and the promotion gate refuses a deliberately worse policy."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RLFLEET = str(Path(sys.executable).parent / "rlfleet")


TINY = """
run_id = "itest"
mode = "{mode}"
group_size = 4
[model]
hidden_size = 64
num_hidden_layers = 2
[warm_start]
demonstrations = 400
epochs = 2
lr = 3e-3
[rollout]
concurrency = 8
max_staleness = 2
[trainer]
groups_per_step = 2
[trainer.optim]
lr = {lr}
[eval]
heldout = 24
regression = 0
[gate]
every_versions = 2
[budget]
max_steps = {steps}
max_minutes = {minutes}
"""


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory):
    """One warm start for the tiny runs of this module (the slowest part of each on a busy machine)."""
    return tmp_path_factory.mktemp("model-cache")


def tiny_run(tmp_path, model_cache, lr: str, mode: str = "async", steps: int = 8,
             minutes: float = 1.5) -> tuple[subprocess.CompletedProcess, dict, Path]:
    config = tmp_path / "tiny.toml"
    config.write_text(TINY.format(lr=lr, mode=mode, steps=steps, minutes=minutes))
    run_dir = tmp_path / "run"
    result = subprocess.run([RLFLEET, "run", str(config), "--run-dir", str(run_dir),
                             "--model-cache-dir", str(model_cache)],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result, json.loads((run_dir / "summary.json").read_text()), run_dir


@pytest.mark.timeout(900)  # a model build, a warm start and a run: past the default 300 s on a busy machine
def test_a_short_async_run_trains_publishes_versions_and_refuses_a_worse_candidate(tmp_path, model_cache):
    # lr 1.0 wrecks the policy on purpose: every candidate is worse, so the gate must refuse them
    # and the fleet keeps serving version 0.
    result, summary, run_dir = tiny_run(tmp_path, model_cache, "1.0")
    # Versions advanced (a wrecked policy soon earns equal rewards in every group, which the trainer
    # drops, so the run may end on its time budget before max_steps).
    assert summary["final_version"] >= 2
    assert summary["trajectories"]["train"] >= 2 * 2 * 4  # groups of G flowed end to end
    # admission + trainer bound (+1: a version may land mid-episode)
    assert summary["staleness"]["max"] <= 2 + 1
    assert summary["gate"], "the gate made no decision"
    assert not any(d["accepted"] for d in summary["gate"])
    # It is refused for being worse (no significant gain, or a significant rise), each check with its
    # interval.
    assert all(any(not c["passed"] for c in d["checks"]) for d in summary["gate"])
    success = [c for d in summary["gate"] for c in d["checks"] if c["name"] == "held-out success"]
    assert (len(success) == len(summary["gate"])
            and all(c["low"] <= c["estimate"] <= c["high"] for c in success))
    assert all(d["tasks"] > 0 for d in summary["gate"])
    # The verifier was audited against the labelled set before the loop, and agreed with it.
    assert summary["verifier_audits"] and summary["verifier_audits"][0]["when"] == "before the loop"
    assert summary["verifier_audits"][0]["breaches"] == [] and not summary["stop_rule"].startswith("verifier")
    assert summary["long_tail"]["total_tokens"] > 0
    assert summary["accepted_version"] == 0
    assert summary["baseline_vs_rl"]["rl_accepted"]["version"] == 0
    assert (run_dir / "report.html").exists() and (run_dir / "report" / "reward_success.png").exists()
    assert "gate: version" in result.stdout and "refused" in result.stdout
    # Version 0 evaluated twice (baseline, final) with the same seeds: the same per-task results.
    evals = {e["label"]: e for e in json.loads((run_dir / "report" / "record.json").read_text())["evals"]}
    outcomes = lambda e: [(t["task_id"], t["passed"], t["invalid_tool_calls"]) for t in e["tasks"]]  # noqa: E731
    assert len(outcomes(evals["baseline"])) == 24 and outcomes(evals["baseline"]) == outcomes(evals["final"])


@pytest.mark.timeout(900)
def test_a_candidate_with_the_accepted_weights_is_never_promoted(tmp_path, model_cache):
    """lr 1e-30: no trained version moves a weight (an Adam step of ~1e-30 is below fp32's resolution
    of any non-zero weight), but versions are served in bf16 (the weight store's `served_dtype`)
    while version 0 is the fp32 base, so each candidate is the accepted policy rounded to bf16:
    equal up to rounding. Sync mode: a gate every 2 steps, each decided before the next step (async
    would end this short budget mid-evaluation). None may be promoted, and none shows a gain."""
    result, summary, _ = tiny_run(tmp_path, model_cache, "1e-30", mode="sync", steps=6, minutes=4)
    assert len(summary["gate"]) >= 2, result.stdout[-3000:]
    assert not any(d["accepted"] for d in summary["gate"]) and summary["accepted_version"] == 0
    success = [c for d in summary["gate"] for c in d["checks"] if c["name"] == "held-out success"]
    assert len(success) == len(summary["gate"]) and all(c["low"] <= 0 and not c["passed"] for c in success)


@pytest.mark.timeout(900)  # a model build, a warm start and a run: past the default 300 s on a busy machine
def test_a_run_on_a_model_directory_of_another_family_trains_and_publishes_versions(tmp_path):
    """`[model] path` names a Llama directory (built here as a Hub checkpoint would be laid out):
    the warm start renders its demonstrations with the model's template, the session server its
    prompts and observations, and the loop trains it (examples/llama.toml, docs/models.md)."""
    corpus = tmp_path / "corpus.txt"
    subprocess.run([sys.executable, "-m", "rlfleet.envkit.corpus", "--out", str(corpus)],
                   check=True, timeout=120)
    model = tmp_path / "llama-tiny"
    subprocess.run([str(Path(sys.executable).parent / "rlfleet-build-model"), "--family", "llama",
                    "--out", str(model),
                    "--corpus", str(corpus), "--hidden-size", "64", "--intermediate-size", "128",
                    "--num-hidden-layers", "2"], check=True, capture_output=True, timeout=300)
    config = tmp_path / "llama.toml"
    config.write_text(f"""
run_id = "itest-llama"
group_size = 4
[model]
path = "{model}"
[warm_start]
demonstrations = 200
epochs = 1
[rollout]
concurrency = 8
max_staleness = 2
observation_framing = "template"
[trainer]
groups_per_step = 2
[eval]
heldout = 8
regression = 0
[gate]
enabled = false
[budget]
max_steps = 3
max_minutes = 1.5
""")
    run_dir = tmp_path / "run"
    result = subprocess.run([RLFLEET, "run", str(config), "--run-dir", str(run_dir),
                             "--model-cache-dir", str(tmp_path / "cache")],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_version"] >= 1
    assert summary["trajectories"]["train"] >= 2 * 4
    (policy,) = (tmp_path / "cache").glob("policy-*")
    assert json.loads((policy / "config.json").read_text())["model_type"] == "llama"
    assert ("<|start_header_id|>"
            in json.loads((policy / "tokenizer_config.json").read_text())["chat_template"])
