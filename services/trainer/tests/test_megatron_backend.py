"""The Megatron-core backend against the torch backend, at TP 1 and TP 2 (torchrun, gloo, real processes).

Each TP size is its own torchrun (megatron_worker.py): Megatron's parallel state is global to a
process; the objectives at one size run one after the other in it. The torch backend runs here, at
world size 1, on the same model and batches.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlfleet.trainer.batching import pack_batch
from rlfleet.trainer.megatron_model import attention_mask
from rlfleet.trainer.testing import run_torchrun, write_tiny_model
from rlfleet.trainer.torch_backend import TorchBackend

sys.path.insert(0, str(Path(__file__).parent))
import megatron_worker as worker

# The `runs` fixture starts three torchrun jobs for seven runs (about 30 s on a quiet 2-core machine,
# minutes on a busy one); its setup counts against the first test that asks for it.
pytestmark = pytest.mark.timeout(2400)
# fp32 on both sides; the two stacks differ in kernels (SDPA vs Megatron's baddbmm + softmax, fused
# vs vocab-parallel log-softmax) and in summation order, not in math.
ATOL = 2e-5


def run_megatron(tmp: Path, model_dir: Path, world: int, tp: int, algorithms: list[str]) -> dict[str, Path]:
    """One torchrun of `world` ranks at TP `tp` that runs each objective in turn; each one's outputs."""
    outs = {algorithm: tmp / f"world{world}-tp{tp}-{algorithm}" for algorithm in algorithms}
    for out in outs.values():
        out.mkdir(parents=True)
    # Generous: the machine may be shared and busy.
    run_torchrun(worker.__file__, [str(model_dir), str(tp), *(f"{out}:{a}" for a, out in outs.items())],
                 world, timeout_s=900 * len(algorithms))
    return outs


def torch_reference(model_dir: Path, algorithm: str) -> dict:
    first, second = worker.steps()
    b = TorchBackend(worker.backend_config(str(model_dir), algorithm))
    reference = TorchBackend(worker.backend_config(str(model_dir), algorithm)) if "+kl" in algorithm else None
    logprobs = b.compute_logprobs(pack_batch(first, worker.PACK))
    steps = [worker.train(b, s, algorithm, reference) for s in (first, second)]
    return {"logprobs": logprobs, "steps": steps, "weights": b.state_dict_for_export()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return write_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_dir):
    """(world size, TP, objective): GRPO at TP 1, TP 2 and data parallel 2; GSPO, PPO, SFT and GRPO with a
    KL penalty to a frozen reference at TP 2. Each runs once; the tests read its outputs."""
    tmp = tmp_path_factory.mktemp("megatron")
    runs = {(1, 1): ["grpo"], (2, 1): ["grpo"], (2, 2): ["grpo", "gspo", "ppo", "sft", "grpo+kl"]}
    return {(world, tp, algorithm): out for (world, tp), algorithms in runs.items()
            for algorithm, out in run_megatron(tmp, model_dir, world, tp, algorithms).items()}


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_hf_to_megatron_to_hf_round_trip_is_exact(runs, model_dir, tp):
    converted = load_file(runs[tp, tp, "grpo"] / "converted.safetensors")
    assert max_diff(converted, load_file(model_dir / "model.safetensors")) == 0.0


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize(("world", "tp"), [(1, 1), (2, 2), (2, 1)], ids=["tp1", "tp2", "dp2"])
def test_grpo_steps_on_megatron_match_the_torch_backend(runs, model_dir, world, tp):
    reference = torch_reference(model_dir, "grpo")
    out = runs[world, tp, "grpo"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["tp"], metrics["dp"]) == (tp, world // tp)
    assert float((torch.load(out / "logprobs.pt") - reference["logprobs"]).abs().max()) <= ATOL
    for ours, theirs in zip(metrics["steps"], reference["steps"], strict=True):
        for key in ("loss", "pg_loss", "entropy", "logprob_gap_mean", "tis_weight_mean", "clip_frac",
                    "approx_kl"):
            assert ours[key] == pytest.approx(theirs[key], abs=ATOL), key
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)
        assert (ours["tokens"], ours["lr"], ours["step"]) == (theirs["tokens"], theirs["lr"], theirs["step"])
    trained = load_file(out / "trained.safetensors")
    assert max_diff(trained, reference["weights"]) <= ATOL
    # The step moved the weights by far more than the tolerance: the comparison can fail.
    assert max_diff(trained, load_file(model_dir / "model.safetensors")) > 100 * ATOL
    served = load_file(out / "hf" / "model.safetensors")
    assert max_diff(served, trained) == 0.0 and (out / "hf" / "tokenizer.json").is_file()


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["gspo", "ppo", "sft", "grpo+kl"])
def test_gspo_ppo_sft_and_kl_steps_at_tp_2_match_the_torch_backend(runs, model_dir, algorithm):
    reference = torch_reference(model_dir, algorithm)
    out = runs[2, 2, algorithm]
    steps = json.loads((out / "metrics.json").read_text())["steps"]
    for ours, theirs in zip(steps, reference["steps"], strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], abs=ATOL)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)
        for key in ("value_loss", "kl", "kl_loss"):
            if key in theirs:
                assert ours[key] == pytest.approx(theirs[key], abs=ATOL), key
    if algorithm == "grpo+kl":
        assert steps[1]["kl"] > 0  # the second step is away from the reference
    assert max_diff(load_file(out / "trained.safetensors"), reference["weights"]) <= ATOL


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("case", [(1, 1, "grpo"), (2, 2, "grpo"), (2, 1, "grpo"), (2, 2, "ppo")])
def test_a_backend_resumed_from_a_checkpoint_retakes_the_step_bit_for_bit(runs, case):
    out = runs[case]
    assert max_diff(load_file(out / "resumed.safetensors"), load_file(out / "trained.safetensors")) == 0.0


def test_the_attention_mask_keeps_packed_sequences_and_padding_apart():
    # Two sequences (lengths 3 and 2) and two padding positions, packed into one row.
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1]])
    blocked = attention_mask(position_ids)[0, 0]
    allowed = {(i, j) for i in range(7) for j in range(7) if not blocked[i, j]}
    segments = [range(0, 3), range(3, 5), range(5, 7)]
    assert allowed == {(i, j) for seg in segments for i in seg for j in seg if j <= i}
