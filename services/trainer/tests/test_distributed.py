"""FSDP2 over gloo: a step at world size 2 is the step at world size 1 (torchrun, real processes)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlfleet.trainer.testing import run_torchrun

WORKER = Path(__file__).with_name("fsdp_worker.py")


def torchrun(nproc: int, out: Path, algorithm: str = "grpo") -> dict:
    out.mkdir(parents=True)
    run_torchrun(WORKER, [str(out), algorithm], nproc, timeout_s=180)
    return json.loads((out / "metrics.json").read_text())


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.integration
@pytest.mark.slow
def test_fsdp_step_at_world_size_two_matches_world_size_one_and_resumes_exactly(tmp_path):
    one = torchrun(1, tmp_path / "ws1")
    two = torchrun(2, tmp_path / "ws2")
    assert (one["world_size"], two["world_size"]) == (1, 2)
    lp1, lp2 = torch.load(tmp_path / "ws1" / "logprobs.pt"), torch.load(tmp_path / "ws2" / "logprobs.pt")
    assert float((lp1 - lp2).abs().max()) <= 1e-6
    for m1, m2 in zip(one["steps"], two["steps"], strict=True):
        assert m2["loss"] == pytest.approx(m1["loss"], abs=1e-6)
        assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-5)
        assert m2["tokens"] == m1["tokens"] and m2["lr"] == m1["lr"]
    w1 = load_file(tmp_path / "ws1" / "hf" / "model.safetensors")
    w2 = load_file(tmp_path / "ws2" / "hf" / "model.safetensors")
    assert max_diff(w1, w2) <= 1e-5
    resumed = load_file(tmp_path / "ws2" / "hf_resumed" / "model.safetensors")
    assert max_diff(w2, resumed) == 0.0


@pytest.mark.integration
@pytest.mark.slow
def test_a_separate_ppo_critic_at_world_size_two_matches_world_size_one_and_resumes_exactly(tmp_path):
    one = torchrun(1, tmp_path / "ws1", "ppo")
    two = torchrun(2, tmp_path / "ws2", "ppo")
    for m1, m2 in zip(one["steps"], two["steps"], strict=True):
        for key in ("loss", "value_loss", "value_mean"):
            assert m2[key] == pytest.approx(m1[key], abs=1e-6), key
        for key in ("grad_norm", "critic_grad_norm"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-5), key
    c1, c2 = (load_file(tmp_path / d / "critic.safetensors") for d in ("ws1", "ws2"))
    assert max_diff(c1, c2) <= 1e-5
    assert max_diff(c2, load_file(tmp_path / "ws2" / "critic_resumed.safetensors")) == 0.0
    w2 = load_file(tmp_path / "ws2" / "hf" / "model.safetensors")
    assert max_diff(w2, load_file(tmp_path / "ws2" / "hf_resumed" / "model.safetensors")) == 0.0
