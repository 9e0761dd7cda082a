"""GSPO and PPO through the whole loop: the shipped examples/calc-gspo.toml and calc-ppo.toml run
under `rlfleet run` for a few steps, shrunk (a tiny model, few rollouts) but with their loss
sections as shipped; the trainer's step metrics, as announced with each version, show which loss ran."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RLFLEET = str(Path(sys.executable).parent / "rlfleet")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SMALL = ["model.hidden_size=64", "model.num_hidden_layers=2", "group_size=4", "warm_start.demonstrations=400",
         "warm_start.epochs=2", "warm_start.lr=3e-3", "rollout.concurrency=8", "trainer.groups_per_step=2",
         "trainer.optim.lr=1e-4", "eval.heldout=16", "eval.regression=0", "gate.every_versions=2",
         "budget.max_steps=3", "budget.max_minutes=3"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("model-cache")  # the warm start is built once for both runs


def run(example: str, tmp_path: Path, cache: Path) -> list[dict]:
    run_dir = tmp_path / "run"
    flags = [arg for kv in SMALL for arg in ("--set", kv)]
    result = subprocess.run([RLFLEET, "run", str(EXAMPLES / example), "--run-dir", str(run_dir),
                             "--model-cache-dir", str(cache), *flags],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_version"] >= 2
    steps = json.loads((run_dir / "report" / "record.json").read_text())["steps"]
    assert len(steps) >= 2
    return [s["metrics"] for s in steps]


def test_gspo_runs_through_the_loop_with_sequence_level_clipping(tmp_path, cache):
    for m in run("calc-gspo.toml", tmp_path, cache):
        assert m["loss"] == m["loss"]  # finite, not NaN
        # The ratio is one per sequence; with the paper's 3e-4/4e-4 clip some sequences are clipped
        # once the policy moves, never more than all of them.
        assert 0.0 <= m["clip_frac"] <= 1.0
        assert abs(m["ratio_mean"] - 1.0) < 0.05
        assert "value_loss" not in m


def test_ppo_runs_through_the_loop_with_a_separate_critic(tmp_path, cache):
    steps = run("calc-ppo.toml", tmp_path, cache)
    for m in steps:
        # The critic's own optimizer step is reported beside the policy's.
        assert {"value_loss", "value_mean", "critic_grad_norm", "critic_lr", "grad_norm"} <= set(m)
        assert m["critic_lr"] == pytest.approx(1e-4)  # [trainer.value_model.optim] as shipped
        assert m["lr"] == pytest.approx(1e-4)
    # The critic starts at V = 0 and learns: its predictions move off zero.
    assert steps[0]["value_mean"] == pytest.approx(0.0, abs=1e-6)
    assert any(abs(m["value_mean"]) > 1e-4 for m in steps[1:])


@pytest.mark.timeout(900)
def test_lora_runs_through_the_loop_as_adapter_versions_on_the_base(tmp_path, cache):
    """examples/calc-lora.toml: the trainer steps an adapter, the store holds adapter versions on
    version 0, the broker loads them on the engines and routes the canary role to the candidate."""
    from rlfleet.weights import DirectoryWeightStore

    steps = run("calc-lora.toml", tmp_path, cache)
    assert all(m["loss"] == m["loss"] for m in steps)
    store = DirectoryWeightStore(tmp_path / "run" / "weights", "calc-lora")
    versions = store.list_versions()
    assert store.index(0).kind == "full" and len(versions) >= 3
    assert all(store.index(v).kind == "adapter" and store.index(v).base_version == 0 for v in versions[1:])
    assert all(store.index(v).total_bytes < store.index(0).total_bytes / 5 for v in versions[1:])
    broker_log = (tmp_path / "run" / "logs" / "weight-broker.log").read_text()
    assert "loaded adapter v" in broker_log and "adapter routes: {'canary'" in broker_log
