import math

import pytest
import torch

from rlfleet.trainer import attention
from rlfleet.trainer.batching import TrainSample, pack_batch, pad_batch
from rlfleet.trainer.config import BatchConfig, LossConfig, TorchBackendConfig
from rlfleet.trainer.objectives import RLObjective, rl_step, with_advantages
from rlfleet.trainer.testing import make_samples, tiny_qwen2_config
from rlfleet.trainer.torch_backend import TorchBackend, lr_factor

torch.set_num_threads(1)


def backend(**overrides) -> TorchBackend:
    cfg = dict(model_config_dict=tiny_qwen2_config(), seed=0,
               optim={"lr": 1e-2, "max_grad_norm": 1.0}, batch={"micro_batch_rows": 2, "pack_length": 64})
    cfg.update(overrides)
    return TorchBackend(TorchBackendConfig(**cfg))


def weights(b: TorchBackend) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in b.model.state_dict().items()}


def on_policy(b: TorchBackend, samples: list[TrainSample]) -> list[TrainSample]:
    """The samples with rollout log-probs of the backend's current policy (as if it had generated them)."""
    batch = pack_batch(samples, 64)
    lps = batch.per_sample(b.compute_logprobs(batch))
    return [TrainSample(s.trajectory_id, s.group_id, s.token_ids,
                        [lp if m else 0.0 for lp, m in zip(lp_.tolist(), s.loss_mask, strict=True)],
                        s.loss_mask, s.reward, s.policy_version) for s, lp_ in zip(samples, lps, strict=True)]


def mean_seq_logprob(b: TorchBackend, samples: list[TrainSample], rewarded: bool) -> float:
    batch = pack_batch(samples, 64)
    lps = batch.per_sample(b.compute_logprobs(batch) * batch.loss_mask)
    return sum(float(lp.sum()) for lp, s in zip(lps, samples, strict=True) if (s.reward > 0) == rewarded)


def test_grpo_training_lowers_the_loss_and_favours_rewarded_sequences():
    b = backend()
    samples = on_policy(b, make_samples(2, 4, seed=1))
    before = (mean_seq_logprob(b, samples, True), mean_seq_logprob(b, samples, False))
    cfg, batch_cfg = LossConfig(tis_cap=2.0), BatchConfig(pack_length=64, micro_batch_rows=2)
    # The samples' own (initial-policy) log-probs are the proximal policy, so the loss can move.
    losses = [rl_step(b, samples, cfg, batch_cfg, recompute_old_logprobs=False)["loss"] for _ in range(6)]
    after = (mean_seq_logprob(b, samples, True), mean_seq_logprob(b, samples, False))
    assert losses[-1] < losses[0] - 0.05, losses
    assert after[0] > before[0] + 1.0 and after[1] < before[1] - 1.0, (before, after)


def test_training_is_bit_identical_under_a_fixed_seed():
    def run() -> dict[str, torch.Tensor]:
        b = backend()
        for _ in range(3):
            rl_step(b, make_samples(2, 4, seed=2), LossConfig(),
                    BatchConfig(pack_length=64, micro_batch_rows=2))
        return weights(b)

    first, second = run(), run()
    assert all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("algorithm", ["grpo", "gspo", "ppo"])
def test_proximal_log_probs_from_the_training_pass_match_a_separate_recomputation(algorithm):
    """rl_step takes the log-probs before the update from its own (detached) forward pass (PPO: its
    pre-update pass computes the values alone, no LM head); a separate no-grad pass over the batch,
    as it used to run, gives the same step."""
    samples = make_samples(2, 4, seed=4)
    ppo = algorithm == "ppo"
    extra = {"critic": "shared"} if ppo else {}
    cfg = LossConfig(algorithm=algorithm, tis_cap=2.0, **extra)
    batch_cfg = BatchConfig(pack_length=64, micro_batch_rows=2)
    fused = backend(optim={"lr": 1e-3}, value_head=ppo)
    m_fused = rl_step(fused, samples, cfg, batch_cfg)
    separate = backend(optim={"lr": 1e-3}, value_head=ppo)
    batch = pack_batch(samples, 64)
    old = separate.forward_inference(batch, with_values=ppo)
    batch = with_advantages(batch, cfg, old.values).replace(old_logprobs=old.logprobs)
    m_separate = separate.train_step(batch, RLObjective(cfg))
    for key in ("loss", "clip_frac", "approx_kl"):
        if key in m_separate:
            assert m_fused[key] == pytest.approx(m_separate[key], abs=1e-5), key
    after_fused, after_separate = weights(fused), weights(separate)
    assert all(torch.allclose(after_fused[k], after_separate[k], atol=1e-5) for k in after_fused)


def test_gradient_accumulation_over_micro_batches_matches_one_big_batch():
    samples = make_samples(2, 4, seed=3)
    results = []
    for rows in (1, 8):
        # Adam's first step is ~lr * sign(g): float noise on near-zero gradients moves weights
        # by up to ~lr * 1e-3.
        b = backend(batch={"micro_batch_rows": rows, "pack_length": 64}, optim={"lr": 1e-3})
        m = rl_step(b, samples, LossConfig(loss_agg="seq_mean"),
                    BatchConfig(pack_length=64, micro_batch_rows=rows))
        results.append((weights(b), m))
    (w1, m1), (w8, m8) = results
    assert max(float((w1[k] - w8[k]).abs().max()) for k in w1) <= 1e-5
    assert m1["loss"] == pytest.approx(m8["loss"], abs=1e-6)
    assert m1["grad_norm"] == pytest.approx(m8["grad_norm"], rel=1e-5)


def test_checkpoint_resume_gives_the_same_next_step_as_an_uninterrupted_run(tmp_path):
    optim = {"lr": 1e-2, "schedule": "cosine", "warmup_steps": 1, "total_steps": 4, "weight_decay": 0.1}
    batches = [make_samples(2, 4, seed=s) for s in (4, 5)]
    steps = (LossConfig(), BatchConfig(pack_length=64, micro_batch_rows=2))
    a = backend(optim=optim)
    rl_step(a, batches[0], *steps)
    a.save_checkpoint(tmp_path / "ckpt")
    expected = rl_step(a, batches[1], *steps)

    b = backend(optim=optim, seed=123)  # different init: everything must come from the checkpoint
    b.load_checkpoint(tmp_path / "ckpt")
    assert b.step == 1
    got = rl_step(b, batches[1], *steps)
    wa, wb = weights(a), weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (got["lr"], got["loss"], got["step"]) == (expected["lr"], expected["loss"], expected["step"])


def test_save_hf_writes_a_model_transformers_loads_with_the_same_outputs(tmp_path):
    import transformers

    b = backend()
    rl_step(b, make_samples(1, 4, seed=6), LossConfig(), BatchConfig(pack_length=64))
    b.save_hf(tmp_path / "hf")
    exported = b.state_dict_for_export()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.config.architectures == ["Qwen2ForCausalLM"]
    assert set(exported) == set(loaded.state_dict())
    ids = torch.tensor([[3, 9, 27, 5, 11]])
    batch = pack_batch([TrainSample("x", "g", ids[0].tolist(), [0.0] * 5, [0, 1, 1, 1, 1], 0.0)], 64)
    ours = b.compute_logprobs(batch)[0, 1:]
    theirs = torch.log_softmax(loaded(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_ppo_trains_the_shared_value_head_towards_the_returns():
    b = backend(value_head=True)
    cfg = LossConfig(algorithm="ppo", gamma=1.0, gae_lambda=0.95, critic="shared")
    samples = make_samples(2, 4, seed=7)
    first = rl_step(b, samples, cfg, BatchConfig(pack_length=64))
    for _ in range(5):
        last = rl_step(b, samples, cfg, BatchConfig(pack_length=64))
    assert {"value_loss", "value_clip_frac", "value_mean", "clip_frac"} <= set(last)
    assert last["value_loss"] < first["value_loss"]


def test_gspo_step_reports_sequence_level_metrics():
    b = backend()
    m = rl_step(b, make_samples(2, 4, seed=8),
                LossConfig(algorithm="gspo", clip_eps_low=3e-4, clip_eps_high=4e-4),
                BatchConfig(pack_length=64))
    # old log-probs recomputed: ratio 1 at the first step
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert math.isfinite(m["loss"]) and m["step"] == 1


def test_logprob_gap_is_reported_against_the_rollout():
    b = backend(optim={"lr": 1e-6})
    samples = on_policy(b, make_samples(1, 4, seed=9))
    m = rl_step(b, samples, LossConfig(), BatchConfig(pack_length=64))
    assert m["logprob_gap_max"] <= 1e-5 and m["tis_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    shifted = [TrainSample(s.trajectory_id, s.group_id, s.token_ids,
                           [lp - 1.0 * m_ for lp, m_ in zip(s.rollout_logprobs, s.loss_mask, strict=True)],
                           s.loss_mask, s.reward) for s in samples]
    m = rl_step(b, shifted, LossConfig(tis_cap=2.0), BatchConfig(pack_length=64))
    # exp(1) = 2.72 > C = 2 on every token.
    assert m["logprob_gap_mean"] == pytest.approx(1.0, abs=1e-3) and m["tis_clip_frac"] == 1.0


def test_lr_schedule_warms_up_linearly_then_follows_a_cosine_and_set_lr_rescales_it():
    from rlfleet.trainer.config import OptimConfig

    o = OptimConfig(lr=1.0, schedule="cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    assert [round(lr_factor(s, o), 6) for s in range(7)] == [
        0.5, 1.0, 1.0, round(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)), 6),
        round(0.1 + 0.9 * 0.5, 6), round(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.75)), 6), 0.1]
    b = backend(optim={"lr": 1e-3, "warmup_steps": 2})
    b.set_lr(4e-3)
    m = rl_step(b, make_samples(1, 2), LossConfig(), BatchConfig(pack_length=64))
    assert m["lr"] == pytest.approx(2e-3)


def test_kl_penalty_against_a_reference_backend_is_zero_at_the_start():
    b, ref = backend(), backend()
    samples = make_samples(2, 2, seed=10)
    batch = with_advantages(pack_batch(samples, 64), LossConfig())
    batch = batch.replace(ref_logprobs=ref.compute_logprobs(batch), old_logprobs=b.compute_logprobs(batch))
    m = b.train_step(batch, RLObjective(LossConfig(kl_coef=0.1)))
    assert m["kl"] == pytest.approx(0.0, abs=1e-6)


def test_bf16_autocast_keeps_fp32_weights_and_close_log_probs():
    fp32, bf16 = backend(), backend(bf16=True)
    batch = pack_batch(make_samples(2, 2, seed=11), 64)
    diff = (fp32.compute_logprobs(batch) - bf16.compute_logprobs(batch)).abs().max()
    assert 0 < float(diff) < 0.1
    m = rl_step(bf16, make_samples(2, 2, seed=11), LossConfig(), BatchConfig(pack_length=64))
    assert math.isfinite(m["loss"]) and all(p.dtype == torch.float32 for p in bf16.model.parameters())


def test_bf16_on_the_cpu_runs_attention_in_fp32_and_packing_still_keeps_sequences_apart(tmp_path):
    fp32, bf16 = backend(), backend(bf16=True)
    assert bf16.hf_model.config._attn_implementation == attention.FP32_SDPA
    assert fp32.hf_model.config._attn_implementation == "sdpa"
    samples = make_samples(2, 3, seed=5)
    per_layout = []
    for batch in (pack_batch(samples, 64), pad_batch(samples)):
        per_layout.append([lp[m > 0] for lp, m in zip(batch.per_sample(bf16.compute_logprobs(batch)),
                                                      batch.per_sample(batch.loss_mask), strict=True)])
    packed, padded = per_layout
    # Packed rows share their attention only through the block-diagonal mask built for the registered
    # implementation: without it the later sequences of a row would attend to the earlier ones.
    for a, b in zip(packed, padded, strict=True):
        assert float((a - b).abs().max()) < 0.02
    bf16.save_hf(tmp_path)  # what engines load must name no attention of this process's own
    assert attention.FP32_SDPA not in (tmp_path / "config.json").read_text()


def test_the_fp32_attention_gives_fp32_sdpa_cast_back_to_the_autocast_dtype():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    attention.register()
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 1
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    expected, _ = sdpa_attention_forward(module, q, k, v, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention._sdpa_fp32(module, q.bfloat16(), k.bfloat16(), v.bfloat16(), None)
    assert out.dtype == torch.bfloat16
    reference, _ = sdpa_attention_forward(module, q.bfloat16().float(), k.bfloat16().float(),
                                          v.bfloat16().float(), None)
    assert torch.equal(out, reference.bfloat16())
    assert float((out.float() - expected).abs().max()) < 0.05


def test_a_checkpoint_of_a_model_with_tied_embeddings_saves_and_restores(tmp_path):
    import torch

    from rlfleet.trainer.config import TorchBackendConfig
    from rlfleet.trainer.testing import tiny_qwen2_config
    from rlfleet.trainer.torch_backend import TorchBackend

    config = tiny_qwen2_config()
    config["tie_word_embeddings"] = True
    backend = TorchBackend(TorchBackendConfig(model_config_dict=config, seed=0))
    backend.save_checkpoint(tmp_path / "ckpt")
    restored = TorchBackend(TorchBackendConfig(model_config_dict=config, seed=1))
    restored.load_checkpoint(tmp_path / "ckpt")
    for (name, a), (_, b) in zip(backend.model.state_dict().items(),
                                 restored.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
