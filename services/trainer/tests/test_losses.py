"""Each objective against numbers worked out by hand from its formula (plain Python floats)."""

import math

import pytest
import torch

from rlfleet.trainer.config import LossConfig
from rlfleet.trainer.losses import (
    LossNorm,
    PolicyInputs,
    entropy_from_logits,
    gae_advantages,
    group_advantages,
    grpo_loss,
    gspo_loss,
    kl_k3,
    ppo_loss,
    sft_loss,
    terminal_rewards,
)
from rlfleet.trainer.losses import value_loss as value_loss_fn

torch.set_num_threads(1)
T = torch.tensor

# Two sequences x three positions; position 0 is the prompt (never scored).
MASK = T([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
SEQ_IDS = T([[0, 0, 0], [1, 1, 1]])
LOGP = T([[0.0, -1.0, -0.5], [0.0, -2.0, -1.0]])
OLD = T([[0.0, -1.2, -0.5], [0.0, -1.5, -1.1]])
ROLLOUT = T([[0.0, -1.3, -0.2], [0.0, -1.5, -2.0]])
# Group of two with rewards 1 and 0: mean 0.5, sample std sqrt(0.5).
STD = math.sqrt(((1 - 0.5) ** 2 + (0 - 0.5) ** 2) / (2 - 1))
A0, A1 = (1 - 0.5) / (STD + 1e-6), (0 - 0.5) / (STD + 1e-6)
ADV = T([[A0, A0, A0], [A1, A1, A1]])


def inputs(**overrides) -> PolicyInputs:
    base = dict(logprobs=LOGP.clone().requires_grad_(), old_logprobs=OLD, rollout_logprobs=ROLLOUT,
                advantages=ADV, mask=MASK, seq_ids=SEQ_IDS)
    base.update(overrides)
    return PolicyInputs(**base)


def test_group_advantages_are_centred_and_divided_by_the_sample_std():
    adv = group_advantages(T([1.0, 0.0, 3.0, 5.0, 7.0]), ["a", "a", "b", "b", "b"])
    # group b: mean 5, sample std sqrt((4 + 0 + 4) / 2) = 2
    expected = [A0, A1, (3 - 5) / (2 + 1e-6), 0.0, (7 - 5) / (2 + 1e-6)]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)


def test_dr_grpo_advantages_are_only_centred():
    adv = group_advantages(T([1.0, 0.0, 3.0, 5.0, 7.0]), ["a", "a", "b", "b", "b"], std_normalize=False)
    assert adv.tolist() == pytest.approx([0.5, -0.5, -2.0, 0.0, 2.0])


def test_a_group_of_one_gets_zero_advantage():
    assert group_advantages(T([4.0]), ["solo"]).tolist() == [0.0]


def _hand_grpo_terms(cap: float = 2.0) -> list[float]:
    """Per-token -min(r A, clip(r) A) * min(exp(old - rollout), C) for the four scored tokens."""
    terms = []
    for lp, old, roll, a in [(-1.0, -1.2, -1.3, A0), (-0.5, -0.5, -0.2, A0),
                             (-2.0, -1.5, -1.5, A1), (-1.0, -1.1, -2.0, A1)]:
        r = math.exp(lp - old)
        clipped = min(max(r, 0.8), 1.2)
        w = min(math.exp(old - roll), cap)
        terms.append(-min(r * a, clipped * a) * w)
    return terms


def test_grpo_token_mean_clips_the_ratio_and_applies_truncated_importance_weights():
    loss, m = grpo_loss(inputs(), LossConfig(clip_eps_low=0.2, clip_eps_high=0.2, tis_cap=2.0))
    terms = _hand_grpo_terms()
    assert loss.item() == pytest.approx(sum(terms) / 4, abs=1e-6)
    assert m["loss"] == pytest.approx(sum(terms) / 4, abs=1e-6)
    # Token 1 of seq 0 (r = e^0.2 > 1.2, A > 0) and token 1 of seq 1 (r = e^-0.5 < 0.8, A < 0) are clipped.
    assert m["clip_frac"] == pytest.approx(2 / 4)
    assert m["ratio_mean"] == pytest.approx((math.exp(0.2) + 1 + math.exp(-0.5)
                                             + math.exp(0.1)) / 4, abs=1e-6)
    # Only the last token's weight exp(0.9) = 2.46 exceeds C = 2.
    assert m["tis_clip_frac"] == pytest.approx(1 / 4)
    assert m["tis_weight_mean"] == pytest.approx((math.exp(0.1) + math.exp(-0.3) + 1 + 2) / 4, abs=1e-6)
    assert m["logprob_gap_mean"] == pytest.approx((0.1 + 0.3 + 0.0 + 0.9) / 4, abs=1e-6)
    assert m["logprob_gap_max"] == pytest.approx(0.9, abs=1e-6)
    assert m["approx_kl"] == pytest.approx((0.5 * 0.2**2 + 0 + 0.5 * 0.5**2 + 0.5 * 0.1**2) / 4, abs=1e-6)


def test_grpo_gradient_is_zero_on_clipped_tokens_and_weighted_elsewhere():
    inp = inputs()
    loss, _ = grpo_loss(inp, LossConfig(tis_cap=2.0))
    loss.backward()
    grad = inp.logprobs.grad
    assert grad[0, 1] == 0.0 and grad[1, 1] == 0.0
    # d/dlp of -r A w / 4 with r = exp(lp - old): -r A w / 4.
    assert float(grad[0, 2]) == pytest.approx(-1.0 * A0 * math.exp(-0.3) / 4, abs=1e-6)
    assert float(grad[1, 2]) == pytest.approx(-math.exp(0.1) * A1 * 2.0 / 4, abs=1e-6)


def test_grpo_without_tis_weights_every_token_by_one():
    loss, m = grpo_loss(inputs(), LossConfig(tis_cap=None))
    terms = _hand_grpo_terms(cap=float("inf"))
    weights = [math.exp(0.1), math.exp(-0.3), 1.0, math.exp(0.9)]
    assert loss.item() == pytest.approx(sum(t / w for t, w in zip(terms, weights, strict=True)) / 4, abs=1e-6)
    assert m["tis_weight_mean"] == pytest.approx(sum(weights) / 4, abs=1e-6)


def test_grpo_sequence_mean_averages_each_sequence_first():
    mask = T([[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]])  # seq 1 scores only its last token
    loss, _ = grpo_loss(inputs(mask=mask), LossConfig(loss_agg="seq_mean", tis_cap=2.0))
    t = _hand_grpo_terms()
    assert loss.item() == pytest.approx(((t[0] + t[1]) / 2 + t[3] / 1) / 2, abs=1e-6)
    token_loss, _ = grpo_loss(inputs(mask=mask), LossConfig(loss_agg="token_mean", tis_cap=2.0))
    assert token_loss.item() == pytest.approx((t[0] + t[1] + t[3]) / 3, abs=1e-6)


def test_k3_kl_penalty_is_added_with_its_coefficient():
    ref = T([[0.0, -1.5, -0.5], [0.0, -2.0, -0.5]])
    loss, m = grpo_loss(inputs(ref_logprobs=ref), LossConfig(kl_coef=0.1, tis_cap=2.0))
    # k3 = exp(ref - lp) - (ref - lp) - 1 per token.
    k3 = [math.exp(d) - d - 1 for d in (-1.5 + 1.0, -0.5 + 0.5, -2.0 + 2.0, -0.5 + 1.0)]
    assert m["kl"] == pytest.approx(sum(k3) / 4, abs=1e-6)
    assert m["kl_loss"] == pytest.approx(0.1 * sum(k3) / 4, abs=1e-6)
    assert loss.item() == pytest.approx(sum(_hand_grpo_terms()) / 4 + 0.1 * sum(k3) / 4, abs=1e-6)
    assert kl_k3(T([-1.0]), T([-1.0])).item() == 0.0


def test_gspo_clips_the_geometric_mean_ratio_per_sequence():
    cfg = LossConfig(algorithm="gspo", clip_eps_low=0.05, clip_eps_high=0.05,
                     loss_agg="seq_mean", tis_cap=2.0)
    loss, m = gspo_loss(inputs(), cfg)
    s0 = math.exp(((-1.0 + 1.2) + (-0.5 + 0.5)) / 2)  # e^0.1 = 1.105 -> clipped to 1.05
    s1 = math.exp(((-2.0 + 1.5) + (-1.0 + 1.1)) / 2)  # e^-0.2 = 0.819 -> clipped to 0.95
    w0 = min(math.exp(((-1.2 + 1.3) + (-0.5 + 0.2)) / 2), 2.0)  # e^-0.1
    w1 = min(math.exp(((-1.5 + 1.5) + (-1.1 + 2.0)) / 2), 2.0)  # e^0.45
    l0 = -min(s0 * A0, 1.05 * A0) * w0
    l1 = -min(s1 * A1, 0.95 * A1) * w1
    assert loss.item() == pytest.approx((l0 + l1) / 2, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(1.0)
    assert m["ratio_mean"] == pytest.approx((s0 + s1) / 2, abs=1e-6)
    assert m["tis_weight_mean"] == pytest.approx((w0 + w1) / 2, abs=1e-6)


def test_gspo_gradient_spreads_the_sequence_ratio_over_its_tokens():
    cfg = LossConfig(algorithm="gspo", clip_eps_low=0.5, clip_eps_high=0.5, loss_agg="seq_mean", tis_cap=None)
    inp = inputs()
    loss, _ = gspo_loss(inp, cfg)
    loss.backward()
    # Unclipped: loss = -(s0 A0 + s1 A1) / 2 and ds_i/dlp_t = s_i / n_i with n_i = 2.
    s0 = math.exp(0.1)
    assert float(inp.logprobs.grad[0, 1]) == pytest.approx(-A0 * s0 / 2 / 2, abs=1e-6)
    assert float(inp.logprobs.grad[0, 2]) == float(inp.logprobs.grad[0, 1])
    assert float(inp.logprobs.grad[0, 0]) == 0.0


def test_gae_skips_observation_tokens_and_resets_between_packed_sequences():
    # One packed row: seq 0 (6 tokens, generated at 1, 2 and 5; 3-4 are a tool observation), seq 1 (3 tokens).
    mask = T([[0.0, 1, 1, 0, 0, 1, 0, 1, 1]])
    seq_ids = T([[0, 0, 0, 0, 0, 0, 1, 1, 1]])
    values = T([[0.0, 0.5, 0.2, 9.0, 9.0, 0.8, 0.0, 0.1, 0.3]])
    rewards = terminal_rewards(T([1.0, 0.0]), mask, seq_ids)
    assert rewards.tolist() == [[0, 0, 0, 0, 0, 1.0, 0, 0, 0]]
    adv, ret = gae_advantages(rewards, values, mask, seq_ids, gamma=0.9, lam=0.8)
    a5 = 1.0 + 0.9 * 0.0 - 0.8
    a2 = (0.0 + 0.9 * 0.8 - 0.2) + 0.9 * 0.8 * a5
    a1 = (0.0 + 0.9 * 0.2 - 0.5) + 0.9 * 0.8 * a2
    b2 = 0.0 + 0.9 * 0.0 - 0.3
    b1 = (0.0 + 0.9 * 0.3 - 0.1) + 0.9 * 0.8 * b2
    assert adv.tolist()[0] == pytest.approx([0, a1, a2, 0, 0, a5, 0, b1, b2], abs=1e-6)
    assert ret.tolist()[0] == pytest.approx(
        [0, a1 + 0.5, a2 + 0.2, 0, 0, a5 + 0.8, 0, b1 + 0.1, b2 + 0.3], abs=1e-6)


def test_ppo_with_a_shared_critic_adds_a_clipped_value_loss():
    values = T([[0.0, 0.9, 0.1], [0.0, 0.3, -0.5]], requires_grad=True)
    old_values = T([[0.0, 0.5, 0.0], [0.0, 0.35, 0.0]])
    returns = T([[0.0, 1.0, 0.5], [0.0, 0.0, -1.0]])
    cfg = LossConfig(algorithm="ppo", value_clip=0.2, value_coef=0.5, tis_cap=2.0, critic="shared")
    loss, m = ppo_loss(inputs(values=values, old_values=old_values, returns=returns), cfg)
    errs = []
    for v, old, r in [(0.9, 0.5, 1.0), (0.1, 0.0, 0.5), (0.3, 0.35, 0.0), (-0.5, 0.0, -1.0)]:
        v_clip = old + min(max(v - old, -0.2), 0.2)
        errs.append(max((v - r) ** 2, (v_clip - r) ** 2))
    value_loss = 0.5 * sum(errs) / 4
    assert m["value_loss"] == pytest.approx(value_loss, abs=1e-6)
    assert loss.item() == pytest.approx(sum(_hand_grpo_terms()) / 4 + 0.5 * value_loss, abs=1e-6)
    # Tokens 1 (0.9 -> 0.7) and 4 (-0.5 -> -0.2) have their clipped error larger.
    assert m["value_clip_frac"] == pytest.approx(2 / 4)
    # A separate critic: the policy's loss is the clipped objective alone, the critic's the value loss.
    separate = cfg.model_copy(update={"critic": "separate"})
    policy_loss, pm = ppo_loss(inputs(), separate)
    assert policy_loss.item() == pytest.approx(sum(_hand_grpo_terms()) / 4,
                                               abs=1e-6) and "value_loss" not in pm
    critic_loss, cm = value_loss_fn(values, old_values, returns, MASK, SEQ_IDS, separate)
    assert critic_loss.item() == pytest.approx(value_loss,
                                               abs=1e-6) and cm["value_clip_frac"] == pytest.approx(0.5)


def test_micro_batch_losses_with_the_global_norm_add_up_to_the_batch_loss():
    cfg = LossConfig(loss_agg="seq_mean", tis_cap=2.0)
    full, _ = grpo_loss(inputs(), cfg)
    norm = LossNorm(num_tokens=4.0, num_seqs=2, seq_num_tokens=T([2.0, 2.0]))
    parts = [grpo_loss(inputs(**{k: v[i:i + 1] for k, v in dict(
        logprobs=LOGP, old_logprobs=OLD, rollout_logprobs=ROLLOUT, advantages=ADV, mask=MASK,
        seq_ids=SEQ_IDS).items()}), cfg, norm)[0] for i in range(2)]
    assert sum(parts).item() == pytest.approx(full.item(), abs=1e-7)


def test_entropy_of_a_uniform_prediction_is_log_vocab():
    logits = torch.zeros(1, 3, 4)
    ent = entropy_from_logits(logits)
    assert ent[0].tolist() == pytest.approx([0.0, math.log(4), math.log(4)], abs=1e-6)
    _, m = grpo_loss(inputs(entropy=T([[0.0, 1.0, 2.0], [0.0, 3.0, 4.0]])), LossConfig())
    assert m["entropy"] == pytest.approx((1 + 2 + 3 + 4) / 4)


def test_sft_loss_is_the_mean_negative_log_likelihood_of_masked_tokens():
    loss, m = sft_loss(LOGP, T([[0.0, 1.0, 0.0], [0.0, 1.0, 1.0]]), SEQ_IDS)
    assert loss.item() == pytest.approx((1.0 + 2.0 + 1.0) / 3)
    assert m["nll"] == pytest.approx(4 / 3)


def test_each_algorithm_gets_its_own_defaults_and_explicit_values_win():
    gspo = LossConfig(algorithm="gspo")
    # The GSPO paper's sequence-ratio clip; a token-level 0.2 would clip almost nothing.
    assert (gspo.clip_eps_low, gspo.clip_eps_high, gspo.loss_agg) == (3e-4, 4e-4, "seq_mean")
    assert (LossConfig().clip_eps_low, LossConfig().clip_eps_high,
            LossConfig().loss_agg) == (0.2, 0.2, "token_mean")
    ppo = LossConfig(algorithm="ppo")
    assert (ppo.clip_eps_low, ppo.clip_eps_high, ppo.loss_agg) == (0.2, 0.2, "token_mean")
    mine = LossConfig(algorithm="gspo", clip_eps_high=0.01, loss_agg="token_mean")
    assert (mine.clip_eps_low, mine.clip_eps_high, mine.loss_agg) == (3e-4, 0.01, "token_mean")
    # What the launcher writes and the service reads back is the same config.
    assert LossConfig.model_validate_json(gspo.model_dump_json()) == gspo
