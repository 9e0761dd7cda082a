"""LoRA on the torch backend: the adapter trains, the base never moves, checkpoints hold the adapter."""

import copy
import json

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from rlfleet.trainer.batching import TrainSample, pack_batch
from rlfleet.trainer.config import BatchConfig, LossConfig, TorchBackendConfig
from rlfleet.trainer.objectives import SFTObjective, rl_step
from rlfleet.trainer.service_config import TrainerConfig
from rlfleet.trainer.testing import make_samples, tiny_qwen2_config, write_tiny_model
from rlfleet.trainer.torch_backend import TorchBackend

torch.set_num_threads(1)

LORA = {"enabled": True, "rank": 4, "alpha": 8.0}
STEP = (LossConfig(), BatchConfig(pack_length=64, micro_batch_rows=2))


def backend(**overrides) -> TorchBackend:
    cfg = dict(model_config_dict=tiny_qwen2_config(), seed=0, lora=LORA,
               optim={"lr": 1e-2, "max_grad_norm": 1.0}, batch={"micro_batch_rows": 2, "pack_length": 64})
    cfg.update(overrides)
    return TorchBackend(TorchBackendConfig(**cfg))


def params(b: TorchBackend) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in b.model.named_parameters()}


def test_a_lora_step_changes_only_the_adapter_and_leaves_the_base_bit_identical():
    b = backend()
    before = params(b)
    adapter = {k for k in before if ".lora_A." in k or ".lora_B." in k}
    assert adapter and {k for k, p in b.model.named_parameters() if p.requires_grad} == adapter
    assert sum(len(g["params"]) for g in b.optimizer.param_groups) == len(adapter)  # no state for the base
    for seed in (1, 2, 3):
        rl_step(b, make_samples(2, 4, seed=seed), *STEP)
    after = params(b)
    assert all(torch.equal(before[k], after[k]) for k in before if k not in adapter)
    assert all(not torch.equal(before[k], after[k]) for k in adapter)
    assert set(b.optimizer.state) == {p for p in b.model.parameters() if p.requires_grad}


def test_lora_plus_steps_lora_b_at_its_ratio_of_the_learning_rate():
    plain, plus = backend(), backend(lora={**LORA, "b_lr_ratio": 16.0})
    assert len(plain.optimizer.param_groups) == 1
    groups = plus.optimizer.param_groups
    names = {id(p): n for n, p in plus.model.named_parameters()}
    assert [g["lr"] for g in groups] == [1e-2, 1e-2 * 16]
    assert all(".lora_A." in names[id(p)] for p in groups[0]["params"])
    assert groups[1]["params"] and all(".lora_B." in names[id(p)] for p in groups[1]["params"])
    # The first step moves only B (A's gradient is zero while B is): Adam's first step is lr * sign,
    # so B moves 16 times as far under LoRA+.
    samples = make_samples(1, 4, seed=7)
    moved = []
    for b in (plain, plus):
        before = params(b)
        b.train_step(pack_batch(samples, 64), SFTObjective())
        moved.append(max((params(b)[k] - before[k]).abs().max().item() for k in before if ".lora_B." in k))
    assert moved[1] == pytest.approx(16 * moved[0], rel=1e-3)
    plus.set_lr(1e-3)  # a new learning rate keeps the ratio
    assert [g["initial_lr"] for g in plus.optimizer.param_groups] == pytest.approx([1e-3, 16e-3])


def test_sft_on_a_lora_backend_trains_the_adapter_only():
    b = backend()
    before = params(b)
    samples = make_samples(1, 4, seed=7)
    b.train_step(pack_batch(samples, 64), SFTObjective())
    changed = {k for k, v in params(b).items() if not torch.equal(v, before[k])}
    assert changed and all(".lora_B." in k for k in changed)  # lora_A moves once B is non-zero


def test_the_merged_export_is_peft_merge_and_unload_and_gives_the_adapters_log_probs(tmp_path):
    import transformers

    b = backend()
    for seed in (1, 2):
        rl_step(b, make_samples(2, 4, seed=seed), *STEP)
    exported = b.state_dict_for_export()
    reference = copy.deepcopy(b.model.lm).merge_and_unload().state_dict()
    assert set(exported) == set(reference)
    assert max(float((exported[k] - reference[k]).abs().max()) for k in exported) < 1e-6
    b.save_hf(tmp_path / "hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.config.architectures == ["Qwen2ForCausalLM"]
    ids = torch.tensor([[3, 9, 27, 5, 11, 40]])
    batch = pack_batch([TrainSample("x", "g", ids[0].tolist(), [0.0] * 6, [0, 1, 1, 1, 1, 1], 0.0)], 64)
    ours = b.compute_logprobs(batch)[0, 1:]
    theirs = torch.log_softmax(loaded(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    assert torch.allclose(ours, theirs, atol=1e-4)


def test_the_exported_adapter_is_the_directory_peft_loads(tmp_path):
    import peft
    import transformers

    model_dir = write_tiny_model(tmp_path / "base")
    b = backend(model_config_dict=None, model_dir=str(model_dir))
    rl_step(b, make_samples(2, 4, seed=1, vocab_size=320), *STEP)
    b.save_adapter(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    tensors, _ = b.adapter_for_export()
    assert set(load_file(tmp_path / "adapter" / "adapter_model.safetensors")) == set(tensors)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    served = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    ids = torch.tensor([[3, 9, 27, 5, 11, 40]])
    batch = pack_batch([TrainSample("x", "g", ids[0].tolist(), [0.0] * 6, [0, 1, 1, 1, 1, 1], 0.0)], 64)
    ours = b.compute_logprobs(batch)[0, 1:]
    theirs = torch.log_softmax(served(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    assert torch.allclose(ours, theirs, atol=1e-5)


@pytest.mark.parametrize("b_lr_ratio", [1.0, 16.0])
def test_a_lora_checkpoint_holds_the_adapter_and_its_optimizer_and_resumes_the_same_next_step(
        tmp_path, b_lr_ratio):
    model_dir = write_tiny_model(tmp_path / "base")
    optim = {"lr": 1e-2, "schedule": "cosine", "warmup_steps": 1, "total_steps": 4, "weight_decay": 0.1}
    batches = [make_samples(2, 4, seed=s, vocab_size=320) for s in (4, 5, 6)]
    lora_settings = {**LORA, "b_lr_ratio": b_lr_ratio}
    a = backend(model_config_dict=None, model_dir=str(model_dir), optim=optim, lora=lora_settings)
    rl_step(a, batches[0], *STEP)
    rl_step(a, batches[1], *STEP)
    a.save_checkpoint(tmp_path / "ckpt")
    expected = rl_step(a, batches[2], *STEP)

    saved = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)  # the frozen base is not copied
    optimizer = torch.load(tmp_path / "ckpt" / "optimizer.pt", weights_only=True)
    assert set(optimizer["state"]) == set(saved)  # Adam moments of the adapter, by name
    # A different seed initialises a different lora_A: the adapter must come from the checkpoint.
    b = backend(model_config_dict=None, model_dir=str(model_dir), optim=optim, seed=123, lora=lora_settings)
    b.load_checkpoint(tmp_path / "ckpt")
    assert b.step == 2
    got = rl_step(b, batches[2], *STEP)
    wa, wb = params(a), params(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (got["lr"], got["loss"], got["step"]) == (expected["lr"], expected["loss"], expected["step"])


def test_a_checkpoint_is_refused_by_a_trainer_with_other_lora_settings(tmp_path):
    a = backend()
    a.save_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="resumes only with the same"):
        backend(lora={**LORA, "rank": 8}).load_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="resumes only with the same"):
        backend(lora={"enabled": False}).load_checkpoint(tmp_path / "ckpt")


def test_lora_on_the_megatron_backend_is_refused_with_a_clear_error():
    with pytest.raises(ValidationError, match="Megatron backend does not train LoRA"):
        TrainerConfig(model_path="m", lora={"enabled": True}, backend={"name": "megatron"})
    assert TrainerConfig(model_path="m", lora={"enabled": True}).torch_backend_config().lora.rank == 8


def test_target_modules_that_match_nothing_are_a_config_error():
    with pytest.raises(ValueError, match="peft cannot wrap this model"):
        backend(lora={**LORA, "target_modules": ["no_such_proj"]})
