"""Every loss, its value and its gradient, against a plain float64 reference written here.

The reference works on python lists of sequences with numpy, one token at a time, from the papers'
formulas; it shares no code with rlfleet.trainer.losses. Gradients of the reference are central
finite differences of its own value (float64, far from the clip kinks, which the data keeps clear
of). The batches are packed rows with padding, prompt and observation tokens (mask 0), ties and
all-equal groups, rewards equal to past float32 precision, both clip sides hit and TIS weights over
the cap; the test asserts that the data really does hit each of those cases.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlfleet.trainer.batching import TrainSample, assemble_batch
from rlfleet.trainer.config import LossConfig
from rlfleet.trainer.losses import (
    LossNorm,
    PolicyInputs,
    gae_advantages,
    group_advantages,
    grpo_loss,
    gspo_loss,
    ppo_loss,
    terminal_rewards,
    value_loss,
)
from rlfleet.trainer.objectives import with_advantages

torch.set_num_threads(1)

# ---------------------------------------------------------------- the reference (numpy, float64)


def ref_group_advantages(rewards, groups, std_normalize=True, eps=1e-6):
    rewards = [float(r) for r in rewards]
    out = [0.0] * len(rewards)
    for g in dict.fromkeys(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        r = np.array([rewards[i] for i in idx], dtype=np.float64)
        if len(r) < 2:
            continue
        mean = sum(r) / len(r)
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / (len(r) - 1))
        for i, x in zip(idx, r, strict=True):
            out[i] = (x - mean) / (std + eps) if std_normalize else x - mean
    return out


def ref_gae(rewards_last, values, gamma, lam):
    """GAE over one sequence's generated tokens only (lists of equal length), reward on the last."""
    n = len(values)
    adv = [0.0] * n
    next_v, last = 0.0, 0.0
    for t in reversed(range(n)):
        r = rewards_last if t == n - 1 else 0.0
        delta = r + gamma * next_v - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
        next_v = values[t]
    return adv, [a + v for a, v in zip(adv, values, strict=True)]


def _agg(per_seq_tokens, mode):
    """per_seq_tokens: a list (one per sequence) of lists of per-token terms."""
    if mode == "token_mean":
        return sum(sum(s) for s in per_seq_tokens) / sum(len(s) for s in per_seq_tokens)
    return sum(sum(s) / len(s) for s in per_seq_tokens) / len(per_seq_tokens)


def _regularisers(seqs, cfg):
    total = 0.0
    if cfg.kl_coef:
        k3 = [[math.exp(rf - lp) - (rf - lp) - 1
               for lp, rf in zip(s["logp"], s["ref"], strict=True)] for s in seqs]
        total += cfg.kl_coef * _agg(k3, cfg.loss_agg)
    if cfg.entropy_coef:
        total -= cfg.entropy_coef * _agg([s["ent"] for s in seqs], cfg.loss_agg)
    return total


def _tis(old, roll, cap):
    return 1.0 if cap is None else min(math.exp(old - roll), cap)


def ref_token_pg(seqs, cfg):
    terms = []
    for s in seqs:
        t_terms = []
        for lp, old, roll, a in zip(s["logp"], s["old"], s["roll"], s["adv"], strict=True):
            r = math.exp(lp - old)
            c = min(max(r, 1 - cfg.clip_eps_low), 1 + cfg.clip_eps_high)
            t_terms.append(max(-a * r, -a * c) * _tis(old, roll, cfg.tis_cap))
        terms.append(t_terms)
    return _agg(terms, cfg.loss_agg)


def ref_grpo(seqs, cfg):
    return ref_token_pg(seqs, cfg) + _regularisers(seqs, cfg)


def ref_gspo(seqs, cfg):
    terms = []
    for s in seqs:
        n = len(s["logp"])
        ratio = math.exp(sum(lp - old for lp, old in zip(s["logp"], s["old"], strict=True)) / n)
        a = sum(s["adv"]) / n
        w = math.exp(sum(o - r for o, r in zip(s["old"], s["roll"], strict=True)) / n)
        w = 1.0 if cfg.tis_cap is None else min(w, cfg.tis_cap)
        c = min(max(ratio, 1 - cfg.clip_eps_low), 1 + cfg.clip_eps_high)
        terms.append([max(-a * ratio, -a * c) * w] * n)  # every token carries its sequence's loss
    return _agg(terms, cfg.loss_agg) + _regularisers(seqs, cfg)


def ref_value_loss(seqs, cfg):
    errs = []
    for s in seqs:
        e = []
        for v, ov, ret in zip(s["v"], s["old_v"], s["ret"], strict=True):
            err = (v - ret) ** 2
            if cfg.value_clip is not None:
                vc = ov + min(max(v - ov, -cfg.value_clip), cfg.value_clip)
                err = max(err, (vc - ret) ** 2)
            e.append(err)
        errs.append(e)
    return 0.5 * _agg(errs, cfg.loss_agg)


def ref_ppo(seqs, cfg):
    policy = ref_token_pg(seqs, cfg) + _regularisers(seqs, cfg)
    return policy + cfg.value_coef * ref_value_loss(seqs, cfg) if cfg.critic == "shared" else policy


def critic_loss(inp, cfg, norm):
    return value_loss(inp.values, inp.old_values, inp.returns, inp.mask, inp.seq_ids, cfg, norm)


REFERENCES = {"grpo": ref_grpo, "gspo": ref_gspo, "ppo": ref_ppo, "critic": ref_value_loss}
LOSSES = {"grpo": grpo_loss, "gspo": gspo_loss, "ppo": ppo_loss, "critic": critic_loss}
DIFFERENTIABLE = ("logp", "ent", "v")


def ref_grad(fn, seqs, cfg, key, h=1e-6):
    grads = []
    for s in seqs:
        g = []
        for t in range(len(s[key])):
            keep = s[key][t]
            s[key][t] = keep + h
            up = fn(seqs, cfg)
            s[key][t] = keep - h
            down = fn(seqs, cfg)
            s[key][t] = keep
            g.append((up - down) / (2 * h))
        grads.append(g)
    return grads


# ---------------------------------------------------------------- the data


def make_case(seed: int, seq_scale: float = 0.35):
    """Groups: ties, all equal (8 x 0.7), near-equal (seven 0.7, one 0.7 + 1e-12), random; packed
    two or three sequences a row, with prompt tokens, observation tokens inside a sequence (multi-turn)
    and padding, all mask 0."""
    rng = np.random.default_rng(seed)
    rewards = ([1.0, 1.0, 0.0, 0.0, 0.5, 0.0] + [0.7] * 8 + [0.7] * 7 + [0.7 + 1e-12] + list(rng.random(6))
               + [0.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    groups = ["tie"] * 6 + ["equal"] * 8 + ["near"] * 8 + ["rand"] * 6 + ["tie2"] * 6
    seqs = []
    for _ in rewards:
        prompt, gen = int(rng.integers(1, 4)), int(rng.integers(2, 7))
        mask = [0.0] * prompt + [1.0] * gen
        if gen >= 4:
            mask[prompt + 2] = 0.0  # a tool observation between two turns
        n = len(mask)
        old = list(-rng.random(n) * 2 - 0.1)
        seqs.append({
            "mask": mask,
            "old": old,
            # Wide enough that token ratios leave [0.8, 1.2] on both sides.
            "logp": [o + d for o, d in zip(old, rng.normal(0, seq_scale, n), strict=True)],
            "roll": [o + d for o, d in zip(old, rng.normal(0, 0.6, n), strict=True)],
            "ref": [o + d for o, d in zip(old, rng.normal(0, 0.3, n), strict=True)],
            "ent": list(rng.random(n) * 3),
            "v": list(rng.normal(0.3, 0.5, n)),
            "old_v": list(rng.normal(0.3, 0.5, n)),
        })
    return rewards, groups, seqs


def pack(seqs, rows_of):
    """Torch [rows, length] tensors from the sequences laid out as `rows_of` (lists of indices), padded."""
    width = max(sum(len(seqs[i]["mask"]) for i in row) for row in rows_of) + 2
    shape = (len(rows_of), width)
    names = ("mask", "old", "logp", "roll", "ref", "ent", "v", "old_v", "adv", "ret")
    fields = {k: torch.zeros(shape, dtype=torch.float64) for k in names}
    seq_ids = torch.full(shape, -1, dtype=torch.long)
    for r, row in enumerate(rows_of):
        pos = 0
        for i in row:
            n = len(seqs[i]["mask"])
            for k in fields:
                if k in seqs[i]:
                    fields[k][r, pos:pos + n] = torch.tensor(seqs[i][k], dtype=torch.float64)
            seq_ids[r, pos:pos + n] = i
            pos += n
    return fields, seq_ids


def loss_tokens(seqs):
    """The reference's view: each sequence restricted to its loss tokens."""
    out = []
    for s in seqs:
        keep = [t for t, m in enumerate(s["mask"]) if m > 0]
        out.append({k: [v[t] for t in keep] for k, v in s.items() if k != "mask" and isinstance(v, list)})
    return out


def with_reference_advantages(seqs, rewards, groups, algorithm, cfg):
    if algorithm == "ppo":
        for s, r in zip(seqs, rewards, strict=True):
            keep = [t for t, m in enumerate(s["mask"]) if m > 0]
            adv, ret = ref_gae(r, [s["old_v"][t] for t in keep], cfg.gamma, cfg.gae_lambda)
            s["adv"], s["ret"] = [0.0] * len(s["mask"]), [0.0] * len(s["mask"])
            for t, a, rt in zip(keep, adv, ret, strict=True):
                s["adv"][t], s["ret"][t] = a, rt
        return
    adv = ref_group_advantages(rewards, groups, cfg.std_normalize, cfg.adv_eps)
    for s, a in zip(seqs, adv, strict=True):
        s["adv"] = [a * m for m in s["mask"]]


CONFIGS = [
    ("grpo", dict(tis_cap=1.5)),
    ("grpo", dict(tis_cap=1.5, loss_agg="seq_mean", kl_coef=0.05, entropy_coef=0.01, clip_eps_high=0.28)),
    ("grpo", dict(tis_cap=None, std_normalize=False)),
    ("gspo", dict(tis_cap=1.5)),  # the paper's clip: 3e-4 / 4e-4
    ("gspo", dict(tis_cap=1.5, clip_eps_low=0.05, clip_eps_high=0.08, loss_agg="token_mean", kl_coef=0.05)),
    ("ppo", dict(tis_cap=1.5, gamma=0.99, gae_lambda=0.9, value_clip=0.2, critic="shared")),
    ("ppo", dict(tis_cap=1.5, value_clip=None, entropy_coef=0.01, loss_agg="seq_mean", critic="shared")),
    ("ppo", dict(tis_cap=1.5, gamma=0.99, gae_lambda=0.9)),  # separate critic: the policy's loss only
    ("critic", dict(value_clip=0.2)),  # the separate critic's loss
    ("critic", dict(value_clip=None, loss_agg="seq_mean")),
]


@pytest.mark.parametrize(("algorithm", "overrides"), CONFIGS)
def test_loss_value_and_gradient_match_the_reference(algorithm, overrides):
    critic = algorithm == "critic"
    if critic:
        algorithm = "ppo"
    cfg = LossConfig(algorithm=algorithm, **overrides)
    rewards, groups, seqs = make_case(seed=len(str(overrides)),
                                     seq_scale=0.35 if algorithm != "gspo" else 4 * cfg.clip_eps_high)
    with_reference_advantages(seqs, rewards, groups, algorithm, cfg)
    ref_seqs = loss_tokens(seqs)
    reference = REFERENCES["critic" if critic else algorithm]

    # The batch really does hit the cases it is meant to.
    tis_over = sum(math.exp(o - r) > cfg.tis_cap for s in ref_seqs
                   for o, r in zip(s["old"], s["roll"], strict=True)
                   ) if cfg.tis_cap else 1
    assert tis_over > 0
    if algorithm == "gspo":
        ratios = [(math.exp(sum(lp - o for lp, o in zip(s["logp"], s["old"], strict=True)) / len(s["logp"])),
                   sum(s["adv"]) / len(s["adv"])) for s in ref_seqs]
    else:
        ratios = [(math.exp(lp - o), a) for s in ref_seqs for lp, o, a in zip(s["logp"], s["old"], s["adv"],
                                                                              strict=True)]
    assert any(r > 1 + cfg.clip_eps_high and a > 0
               for r, a in ratios if abs(a) > 1e-3), "upper clip never active"
    assert any(r < 1 - cfg.clip_eps_low and a < 0 for r, a in ratios), "lower clip never active"
    assert any(1 - cfg.clip_eps_low < r < 1 + cfg.clip_eps_high and a != 0 for r, a in ratios)

    rows_of = [[0, 1, 2], [3, 4], [5], [6, 7, 8]] + [[i, i + 1] for i in range(9, len(seqs) - 1, 2)]
    if len(seqs) % 2 == 0:
        rows_of.append([len(seqs) - 1])
    f, seq_ids = pack(seqs, rows_of)
    leaves = {k: f[k].clone().requires_grad_() for k in DIFFERENTIABLE}
    inp = PolicyInputs(logprobs=leaves["logp"], old_logprobs=f["old"], rollout_logprobs=f["roll"],
                       advantages=f["adv"], mask=f["mask"], seq_ids=seq_ids,
                       ref_logprobs=f["ref"] if cfg.kl_coef else None, entropy=leaves["ent"],
                       values=leaves["v"] if algorithm == "ppo"
                       and (critic or cfg.critic == "shared") else None,
                       old_values=f["old_v"] if algorithm == "ppo" else None,
                       returns=f["ret"] if algorithm == "ppo" else None)
    norm = LossNorm(float(f["mask"].sum()), len(seqs),
                    torch.tensor([sum(s["mask"]) for s in seqs], dtype=torch.float64))
    loss, metrics = LOSSES["critic" if critic else algorithm](inp, cfg, norm)
    expected = reference(ref_seqs, cfg)
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-10, abs=1e-12)
    assert metrics["value_loss" if critic else "loss"] == pytest.approx(expected, rel=1e-10, abs=1e-12)
    loss.backward()

    if critic:
        keys = ["v"]
    else:
        keys = ["logp"] + (["ent"] if cfg.entropy_coef else []) + (["v"] if cfg.critic == "shared" else [])
    for key in keys:
        got = leaves[key].grad
        want = ref_grad(reference, ref_seqs, cfg, key)
        for s_idx, row_grads in enumerate(want):
            r = next(r for r, row in enumerate(rows_of) if s_idx in row)
            positions = [p for p in range(seq_ids.shape[1]) if seq_ids[r, p] == s_idx and f["mask"][r, p] > 0]
            got_seq = [float(got[r, p]) for p in positions]
            assert got_seq == pytest.approx(row_grads, rel=1e-6, abs=1e-9), (key, s_idx)
        # Nothing flows into prompt, observation or padding positions.
        assert float((got * (1 - f["mask"])).abs().sum()) == 0.0, key


# ---------------------------------------------------------------- advantages


ALL_EQUAL = [[0.7] * 8, [0.1] * 7, [0.3] * 6, [0.9] * 3, [0.7] * 7 + [0.7 + 1e-12]]


@pytest.mark.parametrize("rewards", ALL_EQUAL, ids=["8x0.7", "7x0.1", "6x0.3", "3x0.9", "near-equal"])
@pytest.mark.parametrize("std_normalize", [True, False])
def test_all_equal_and_near_equal_groups_get_no_advantage(rewards, std_normalize):
    # float32 centring gave +0.056 to every member of 8 x 0.7; the near-equal group differs by 1e-12,
    # so its advantages are at most (1e-12 / (std + 1e-6)) ~ 1e-6.
    adv = group_advantages(torch.tensor(rewards, dtype=torch.float64), ["g"] * len(rewards), std_normalize)
    want = ref_group_advantages(rewards, ["g"] * len(rewards), std_normalize)
    assert adv.abs().max() < 1e-6
    assert adv.tolist() == pytest.approx(want, abs=1e-7)
    if len(set(rewards)) == 1:
        assert adv.tolist() == [0.0] * len(rewards)


def test_group_advantages_match_the_reference_with_ties_and_mixed_groups():
    rewards, groups, _ = make_case(seed=3)
    for std_normalize in (True, False):
        adv = group_advantages(torch.tensor(rewards, dtype=torch.float64), groups, std_normalize)
        assert adv.tolist() == pytest.approx(ref_group_advantages(rewards, groups, std_normalize), abs=1e-6)


def test_advantages_through_the_batch_see_rewards_past_float32_precision():
    """From samples to per-token advantages (what `rl_step` does): nothing rounds rewards to float32."""
    rewards = [0.7] * 7 + [0.7 + 1e-12] + [0.7] * 8
    groups = ["near"] * 8 + ["equal"] * 8
    samples = [TrainSample(token_ids=[1, 2, 3, 4], loss_mask=[0, 1, 1, 1],
                           rollout_logprobs=[0.0, -1.0, -1.0, -1.0], reward=r, group_id=g,
                           trajectory_id=f"t{i}", policy_version=0)
               for i, (r, g) in enumerate(zip(rewards, groups, strict=True))]
    batch = with_advantages(assemble_batch(samples), LossConfig())
    assert batch.rewards.dtype == torch.float64
    adv = batch.advantages[batch.loss_mask > 0]
    assert float(adv.abs().max()) < 1e-6
    want = ref_group_advantages(rewards, groups)
    per_seq = [float(batch.advantages[batch.seq_ids == i][-1]) for i in range(len(samples))]
    assert per_seq == pytest.approx(want, abs=1e-7)


def test_gae_matches_the_reference_over_generated_tokens_only():
    rewards, _, seqs = make_case(seed=5)
    rows_of = [[i, i + 1] for i in range(0, len(seqs), 2)]
    f, seq_ids = pack(seqs, rows_of)
    token_rewards = terminal_rewards(torch.tensor(rewards), f["mask"], seq_ids)
    adv, ret = gae_advantages(token_rewards, f["old_v"], f["mask"], seq_ids, gamma=0.99, lam=0.9)
    for i, s in enumerate(seqs):
        keep = [t for t, m in enumerate(s["mask"]) if m > 0]
        want_adv, want_ret = ref_gae(rewards[i], [s["old_v"][t] for t in keep], 0.99, 0.9)
        r = next(r for r, row in enumerate(rows_of) if i in row)
        positions = [p for p in range(seq_ids.shape[1]) if seq_ids[r, p] == i and f["mask"][r, p] > 0]
        assert [float(adv[r, p]) for p in positions] == pytest.approx(want_adv, abs=1e-5)
        assert [float(ret[r, p]) for p in positions] == pytest.approx(want_ret, abs=1e-5)
