import pytest
import torch

from rlfleet.trainer.batching import (
    TrainSample,
    micro_batches,
    pack_batch,
    pack_rows,
    pad_batch,
    shard_rows,
    split_mini_batches,
)
from rlfleet.trainer.config import TorchBackendConfig
from rlfleet.trainer.testing import make_samples, tiny_qwen2_config
from rlfleet.trainer.torch_backend import TorchBackend

torch.set_num_threads(1)


def sample(tid: str, tokens: list[int], mask: list[int], reward: float = 0.0,
           group: str = "g") -> TrainSample:
    return TrainSample(tid, group, tokens, [-0.5 * m for m in mask], mask, reward)


def test_padding_right_pads_with_an_attention_mask_and_keeps_tokens_exact():
    b = pad_batch([sample("a", [5, 6, 7], [0, 1, 1]), sample("b", [8, 9], [0, 1])], pad_token_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7], [8, 9, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert b.seq_ids.tolist() == [[0, 0, 0], [1, 1, -1]]
    assert b.loss_mask.tolist() == [[0, 1, 1], [0, 1, 0]]
    assert b.rollout_logprobs.tolist() == [[0, -0.5, -0.5], [0, -0.5, 0]]
    assert (b.num_loss_tokens, b.num_seqs, b.seq_num_loss_tokens.tolist()) == (3.0, 2, [2.0, 1.0])


def test_packing_restarts_positions_per_sequence_and_has_no_attention_mask():
    samples = [sample("a", [5, 6, 7], [0, 1, 1]), sample("b", [8, 9], [0, 1]),
               sample("c", [1, 2, 3, 4], [0, 0, 1, 1])]
    b = pack_batch(samples, pack_length=6)
    assert b.attention_mask is None
    # First-fit decreasing: c (4) opens row 0, a (3) opens row 1, b (2) fits after c.
    assert b.input_ids.tolist() == [[1, 2, 3, 4, 8, 9], [5, 6, 7, 0, 0, 0]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 1, 2]]
    assert b.seq_ids.tolist() == [[2, 2, 2, 2, 1, 1], [0, 0, 0, -1, -1, -1]]
    assert [t.tolist() for t in b.per_sample(b.input_ids)] == [[5, 6, 7], [8, 9], [1, 2, 3, 4]]


def test_a_sequence_longer_than_the_pack_length_gets_its_own_row():
    assert pack_rows([10, 3, 3], pack_length=6) == [[0], [1, 2]]


def test_samples_that_break_the_token_contract_are_rejected():
    with pytest.raises(ValueError, match="differ in length"):
        TrainSample("x", "g", [1, 2], [0.0], [0, 1], 1.0)
    with pytest.raises(ValueError, match="first token"):
        TrainSample("x", "g", [1, 2], [0.0, 0.0], [1, 1], 1.0)


def test_oldest_policy_version_looks_only_at_generated_tokens():
    s = TrainSample("x", "g", [1, 2, 3, 4], [0.0] * 4, [0, 1, 0, 1], 1.0, policy_version=[0, 3, 9, 4])
    assert s.oldest_policy_version == 3


def test_rank_shards_are_disjoint_cover_every_row_and_balance_tokens():
    b = pack_batch(make_samples(6, 4, lengths=(5, 30)), pack_length=40)
    shards = [shard_rows(b, r, 3) for r in range(3)]
    assert sorted(r for shard in shards for r in shard) == list(range(b.num_rows))
    loads = [int((b.seq_ids[s] >= 0).sum()) for s in shards]
    assert max(loads) - min(loads) <= 40


def test_micro_batches_keep_global_normalisation_and_trim_padding_columns():
    b = pad_batch([sample("a", [5, 6, 7, 8], [0, 1, 1, 1]), sample("b", [8, 9], [0, 1])])
    _, second = micro_batches(b, [0, 1], 1)
    assert second.input_ids.tolist() == [[8, 9]]
    assert (second.num_loss_tokens, second.num_seqs) == (4.0, 2)


def test_mini_batches_are_normalised_on_their_own():
    b = pad_batch([sample("a", [5, 6, 7, 8], [0, 1, 1, 1]), sample("b", [8, 9], [0, 1])])
    first, second = split_mini_batches(b, 2)
    assert (first.num_loss_tokens, first.num_seqs) == (3.0, 1)
    assert (second.num_loss_tokens, second.num_seqs) == (1.0, 1)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_padded_and_packed_batches_give_the_per_sequence_log_probs(attn):
    backend = TorchBackend(TorchBackendConfig(model_config_dict=tiny_qwen2_config(), attn_implementation=attn,
                                              batch={"micro_batch_rows": 3}))
    samples = make_samples(4, 3, lengths=(4, 20))
    alone = [backend.compute_logprobs(pad_batch([s]))[0] for s in samples]
    for batch in (pad_batch(samples), pack_batch(samples, pack_length=48)):
        per_sample = batch.per_sample(backend.compute_logprobs(batch))
        worst = max(float((got - want).abs().max()) for got, want in zip(per_sample, alone, strict=True))
        assert worst <= 1e-5, (batch.layout, worst)
    assert pack_batch(samples, pack_length=48).num_rows < len(samples)


def _step_gradients(layout: str, algorithm: str, attn: str, samples: list[TrainSample]):
    """The per-token log-probs and the gradient of one rl_step (optimizer step and zeroing disabled)."""
    from rlfleet.trainer.config import BatchConfig, LossConfig
    from rlfleet.trainer.objectives import rl_step

    ppo = algorithm == "ppo"
    backend = TorchBackend(TorchBackendConfig(
        model_config_dict=tiny_qwen2_config(), attn_implementation=attn, value_head=ppo, seed=0,
        optim={"max_grad_norm": None}, batch={"micro_batch_rows": 2, "layout": layout, "pack_length": 48}))
    batch_cfg = BatchConfig(layout=layout, pack_length=48, micro_batch_rows=2)
    batch = pack_batch(samples, 48) if layout == "packed" else pad_batch(samples)
    logprobs = batch.per_sample(backend.compute_logprobs(batch))
    backend.optimizer.step = lambda *a, **k: None
    backend.optimizer.zero_grad = lambda *a, **k: None
    loss_cfg = LossConfig(algorithm=algorithm, tis_cap=2.0, **({"critic": "shared"} if ppo else {}))
    metrics = rl_step(backend, samples, loss_cfg, batch_cfg)
    grads = {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.grad is not None}
    return logprobs, grads, metrics


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("algorithm", ["grpo", "gspo", "ppo"])
def test_packed_and_padded_steps_give_the_same_log_probs_loss_and_gradient(algorithm, attn):
    """Packing is a layout, not a different step: in fp32 the per-token log-probs, the loss and every
    parameter's gradient match the padded batch's (the packed rows hold several samples each, so a
    mask that let one sample see another would show here)."""
    samples = make_samples(3, 4, lengths=(4, 20), seed=7)
    lp_pad, g_pad, m_pad = _step_gradients("padded", algorithm, attn, samples)
    lp_pack, g_pack, m_pack = _step_gradients("packed", algorithm, attn, samples)
    assert pack_batch(samples, 48).num_rows <= len(samples) // 2
    worst = max(float((a - b).abs().max()) for a, b in zip(lp_pack, lp_pad, strict=True))
    assert worst <= 1e-5, worst
    assert m_pack["loss"] == pytest.approx(m_pad["loss"], abs=1e-6)
    assert g_pack.keys() == g_pad.keys() and len(g_pad) > 0
    for name in g_pad:
        scale = float(g_pad[name].abs().max()) or 1.0
        assert float((g_pack[name] - g_pad[name]).abs().max()) <= 1e-5 * max(scale, 1.0), name
    assert any(float(g.abs().max()) > 0 for g in g_pad.values())
