"""RL and SFT objectives as pure functions on aligned per-token tensors.

Conventions (see batching.py): every per-token tensor has the same shape (usually [rows, length]),
position t holds the quantity for predicting token t; `mask` is 1.0 on the tokens the loss applies to
(generated tokens) and `seq_ids` maps positions to sample indices (-1 on padding).

Three log-probs meet here:
- `logprobs`: the policy being trained (with grad);
- `old_logprobs`: the trainer's own log-probs of the batch before this update (the proximal policy of
  the clipped ratio);
- `rollout_logprobs`: what the engine reported while sampling (a stale policy version and a different
  numeric stack). Truncated importance sampling re-weights by min(exp(old - rollout), C) so that the
  update stays unbiased-ish for the data's true behaviour policy, and the gap is reported.

Normalisation uses a `LossNorm` with batch-global counts, so the sum of a batch's micro-batch losses
is the loss of the whole batch, on one rank or many. Metrics are means over the call's loss tokens,
except the loss terms (`loss`, `*_loss`, contributions to the global loss) and maxima (`*_max`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlfleet.trainer.config import LossConfig

Metrics = dict[str, float]


@dataclass
class LossNorm:
    """Batch-global denominators; `seq_num_tokens` is indexed by sample index."""

    num_tokens: float
    num_seqs: int
    seq_num_tokens: torch.Tensor

    @classmethod
    def local(cls, mask: torch.Tensor, seq_ids: torch.Tensor) -> LossNorm:
        num_seqs = int(seq_ids.max()) + 1 if seq_ids.numel() else 0
        counts = torch.zeros(max(num_seqs, 1)).index_add_(0, seq_ids.clamp(min=0).flatten(), mask.flatten())
        return cls(float(mask.sum()), int((counts > 0).sum()), counts)


@dataclass
class PolicyInputs:
    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    seq_ids: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None


# ---------------------------------------------------------------- advantages


def group_advantages(rewards: torch.Tensor, group_ids: Sequence[str], std_normalize: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """(r - mean_group) / (std_group + eps), std with Bessel's correction; Dr.GRPO: r - mean_group.

    Centred in float64: a float32 mean of eight rewards of 0.7 is one ulp off while the std is
    exactly 0, which made every member's advantage 0.056 instead of 0. A group whose rewards are all
    equal gets exactly 0, and so does a group of one (its std is 0).
    """
    out = torch.zeros(rewards.shape, dtype=torch.float64)
    r_all = rewards.detach().to(torch.float64)
    for gid in dict.fromkeys(group_ids):
        idx = torch.tensor([i for i, g in enumerate(group_ids) if g == gid])
        r = r_all[idx]
        if len(idx) < 2 or bool((r == r[0]).all()):
            continue
        centred = r - r.mean()
        if std_normalize:
            centred = centred / (r.std() + eps)
        out[idx] = centred
    return out.to(torch.float32)


def terminal_rewards(rewards: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """Per-token rewards with each sequence's reward on its last generated token, 0 elsewhere."""
    flat_mask = mask.flatten() > 0
    positions = torch.arange(mask.numel())
    seq = seq_ids.flatten()
    last = torch.full((rewards.numel(),), -1, dtype=torch.long)
    last.scatter_reduce_(0, seq[flat_mask], positions[flat_mask], reduce="amax")
    out = torch.zeros(mask.numel())
    has = last >= 0
    out[last[has]] = rewards[has].to(torch.float32)
    return out.view_as(mask)


def gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                   seq_ids: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over each sequence's generated tokens, [rows, length] in, (advantages, returns) out.

    Observation and prompt tokens (mask 0) are skipped, not treated as steps: the next state after a
    generated token is the next *generated* token of the same sequence, and the episode ends after the
    last one (bootstrap value 0). The scan resets wherever the sample changes, so packed rows work.
    """
    rows, length = mask.shape
    adv = torch.zeros(rows, length)
    next_value = torch.zeros(rows)
    last_gae = torch.zeros(rows)
    next_seq = torch.full((rows,), -2, dtype=torch.long)
    values = values.detach().to(torch.float32)
    for t in reversed(range(length)):
        new_seq = seq_ids[:, t] != next_seq
        next_value = torch.where(new_seq, 0.0, next_value)
        last_gae = torch.where(new_seq, 0.0, last_gae)
        m = mask[:, t] > 0
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        adv[:, t] = torch.where(m, gae, 0.0)
        next_value = torch.where(m, values[:, t], next_value)
        last_gae = torch.where(m, gae, last_gae)
        next_seq = seq_ids[:, t]
    returns = (adv + values) * mask
    return adv, returns


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    n = mask.sum()
    mean = (x * mask).sum() / n
    var = (((x - mean) * mask) ** 2).sum() / (n - 1).clamp(min=1)
    return (x - mean) / (var.sqrt() + eps) * mask


# ---------------------------------------------------------------- per-token pieces


def logprobs_from_logits(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Aligned log p(input_ids[t] | < t) from logits [R, L, V]; position 0 gets 0."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    chosen = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(chosen, (1, 0))


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Aligned entropy of the distribution that predicted token t; position 0 gets 0."""
    logits = logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    return torch.nn.functional.pad(ent, (1, 0))


def logprobs_and_entropy(logits: torch.Tensor, input_ids: torch.Tensor, entropy: bool = True,
                         entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`logprobs_from_logits` and `entropy_from_logits` from one log-softmax over the vocabulary
    (the same values; the softmax of [R, L, V] is the costliest op after the LM head). The entropy
    keeps its graph only with `entropy_grad`; entropy=False skips it (log-probs alone)."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    chosen = torch.nn.functional.pad(logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1), (1, 0))
    if not entropy:
        return chosen, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        src = logp if entropy_grad else logp.detach()
        ent = -(src.exp() * src).sum(-1)
    return chosen, torch.nn.functional.pad(ent, (1, 0))


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token: exp(ref - logp) - (ref - logp) - 1 >= 0."""
    d = ref_logprobs - logprobs
    return d.exp() - d - 1.0


def tis_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float | None,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(min(exp(old - rollout), cap), raw weight), detached; 1 where masked or when TIS is off."""
    raw = torch.exp((old_logprobs - rollout_logprobs).detach() * mask)
    if cap is None:
        return torch.ones_like(raw), raw
    return raw.clamp(max=cap), raw


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor, norm: LossNorm,
              mode: str) -> torch.Tensor:
    """token_mean: sum / all loss tokens of the batch; seq_mean: per-sequence means
    averaged over sequences."""
    if mode == "token_mean":
        return (per_token * mask).sum() / max(norm.num_tokens, 1.0)
    if mode == "seq_mean":
        n = norm.seq_num_tokens.to(per_token.dtype)[seq_ids.clamp(min=0)].clamp(min=1.0)
        return (per_token * mask / n).sum() / max(norm.num_seqs, 1)
    raise ValueError(f"unknown loss aggregation {mode!r}")


def _item(x: torch.Tensor) -> float:
    return float(x.detach())


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float((x.detach() * mask).sum() / mask.sum().clamp(min=1.0))


def _masked_max(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float(torch.where(mask > 0, x.detach(), float("-inf")).max()) if mask.any() else 0.0


def _diagnostics(inp: PolicyInputs, raw_tis: torch.Tensor, cap: float | None) -> Metrics:
    m = inp.mask
    gap = (inp.old_logprobs - inp.rollout_logprobs).abs()
    out = {
        "logprob_gap_mean": _masked_mean(gap, m),
        "logprob_gap_max": _masked_max(gap, m),
        "tis_weight_mean": _masked_mean(raw_tis.clamp(max=cap) if cap else raw_tis, m),
        "tis_clip_frac": _masked_mean((raw_tis > cap).float(), m) if cap else 0.0,
        "advantage_mean": _masked_mean(inp.advantages, m),
    }
    if inp.entropy is not None:
        out["entropy"] = _masked_mean(inp.entropy, m)
    return out


def _regularisers(inp: PolicyInputs, cfg: LossConfig, norm: LossNorm) -> tuple[torch.Tensor, Metrics]:
    total = inp.logprobs.new_zeros(())
    metrics: Metrics = {}
    if inp.ref_logprobs is not None:
        kl = kl_k3(inp.logprobs, inp.ref_logprobs)
        metrics["kl"] = _masked_mean(kl, inp.mask)
        if cfg.kl_coef > 0:
            kl_loss = cfg.kl_coef * aggregate(kl, inp.mask, inp.seq_ids, norm, cfg.loss_agg)
            metrics["kl_loss"] = _item(kl_loss)
            total = total + kl_loss
    elif cfg.kl_coef > 0:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if cfg.entropy_coef > 0:
        if inp.entropy is None:
            raise ValueError("entropy_coef > 0 needs the per-token entropy")
        ent_loss = -cfg.entropy_coef * aggregate(inp.entropy, inp.mask, inp.seq_ids, norm, cfg.loss_agg)
        metrics["entropy_loss"] = _item(ent_loss)
        total = total + ent_loss
    return total, metrics


# ---------------------------------------------------------------- objectives


def _clipped_token_objective(inp: PolicyInputs, cfg: LossConfig,
                             norm: LossNorm) -> tuple[torch.Tensor, Metrics]:
    m = inp.mask
    log_ratio = (inp.logprobs - inp.old_logprobs.detach()) * m
    ratio = log_ratio.exp()
    clipped = ratio.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    adv = inp.advantages.detach()
    unclipped_loss, clipped_loss = -adv * ratio, -adv * clipped
    weights, raw_tis = tis_weights(inp.old_logprobs, inp.rollout_logprobs, cfg.tis_cap, m)
    per_token = torch.maximum(unclipped_loss, clipped_loss) * weights
    pg_loss = aggregate(per_token, m, inp.seq_ids, norm, cfg.loss_agg)
    metrics = {
        "pg_loss": _item(pg_loss),
        "clip_frac": _masked_mean((clipped_loss > unclipped_loss).float(), m),
        "ratio_mean": _masked_mean(ratio, m),
        "approx_kl": _masked_mean(0.5 * log_ratio**2, m),
        **_diagnostics(inp, raw_tis, cfg.tis_cap),
    }
    return pg_loss, metrics


def grpo_loss(inp: PolicyInputs, cfg: LossConfig,
              norm: LossNorm | None = None) -> tuple[torch.Tensor, Metrics]:
    """Token-level clipped ratio objective (PPO-clip with TIS), plus optional k3 KL and entropy bonus."""
    norm = norm or LossNorm.local(inp.mask, inp.seq_ids)
    pg_loss, metrics = _clipped_token_objective(inp, cfg, norm)
    reg, reg_metrics = _regularisers(inp, cfg, norm)
    loss = pg_loss + reg
    return loss, {"loss": _item(loss), **metrics, **reg_metrics}


def _per_sequence_mean(x: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor,
                       norm: LossNorm) -> torch.Tensor:
    """Mean of x over each sequence's loss tokens, as a [S] tensor (0 for sequences not present)."""
    sums = x.new_zeros(norm.seq_num_tokens.numel()).index_add(0, seq_ids.clamp(min=0).flatten(),
                                                             (x * mask).flatten())
    return sums / norm.seq_num_tokens.to(x.dtype).clamp(min=1.0)


def gspo_loss(inp: PolicyInputs, cfg: LossConfig,
              norm: LossNorm | None = None) -> tuple[torch.Tensor, Metrics]:
    """GSPO: s_i = exp(mean_t log(pi/pi_old)) per sequence, loss_i = -min(s_i A_i, clip(s_i) A_i).

    TIS is applied per sequence with the same geometric mean: w_i = min(exp(mean_t (old - rollout)), C).
    Every token of sequence i carries loss_i, so `seq_mean` averages over sequences (the paper's form)
    and `token_mean` weights each sequence by its length. Requires whole sequences per call.
    """
    norm = norm or LossNorm.local(inp.mask, inp.seq_ids)
    m, seq = inp.mask, inp.seq_ids.clamp(min=0)
    log_s = _per_sequence_mean(inp.logprobs - inp.old_logprobs.detach(), m, inp.seq_ids, norm)
    s = log_s.exp()
    adv = _per_sequence_mean(inp.advantages.detach(), m, inp.seq_ids, norm)
    clipped = s.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    unclipped_loss, clipped_loss = -adv * s, -adv * clipped
    log_w = _per_sequence_mean((inp.old_logprobs - inp.rollout_logprobs).detach(), m, inp.seq_ids, norm)
    raw_w = log_w.exp()
    w = raw_w.clamp(max=cfg.tis_cap) if cfg.tis_cap is not None else torch.ones_like(raw_w)
    per_seq = torch.maximum(unclipped_loss, clipped_loss) * w
    pg_loss = aggregate(per_seq[seq], m, inp.seq_ids, norm, cfg.loss_agg)
    reg, reg_metrics = _regularisers(inp, cfg, norm)
    loss = pg_loss + reg
    _, raw_tis_tokens = tis_weights(inp.old_logprobs, inp.rollout_logprobs, cfg.tis_cap, m)
    metrics = {
        "loss": _item(loss),
        "pg_loss": _item(pg_loss),
        "clip_frac": _masked_mean((clipped_loss > unclipped_loss).float()[seq], m),
        "ratio_mean": _masked_mean(s[seq], m),
        "approx_kl": _masked_mean(0.5 * ((inp.logprobs - inp.old_logprobs) * m) ** 2, m),
        **_diagnostics(inp, raw_tis_tokens, cfg.tis_cap),
        # The weights GSPO actually applies are per sequence.
        "tis_weight_mean": _masked_mean(w[seq], m),
        "tis_clip_frac": _masked_mean((raw_w > cfg.tis_cap).float()[seq], m) if cfg.tis_cap else 0.0,
        **reg_metrics,
    }
    return loss, metrics


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               seq_ids: torch.Tensor, cfg: LossConfig,
               norm: LossNorm | None = None) -> tuple[torch.Tensor, Metrics]:
    """The clipped value loss 0.5 * max((v - R)^2, (v_clip - R)^2),
    v_clip = old_v + clip(v - old_v, +-value_clip)."""
    norm = norm or LossNorm.local(mask, seq_ids)
    v = values.to(torch.promote_types(values.dtype, torch.float32))  # bf16 up, float64 kept
    old_v, ret = old_values.detach(), returns.detach()
    err = (v - ret) ** 2
    metrics: Metrics = {}
    if cfg.value_clip is not None:
        v_clipped = old_v + (v - old_v).clamp(-cfg.value_clip, cfg.value_clip)
        err_clipped = (v_clipped - ret) ** 2
        metrics["value_clip_frac"] = _masked_mean((err_clipped > err).float(), mask)
        err = torch.maximum(err, err_clipped)
    loss = 0.5 * aggregate(err, mask, seq_ids, norm, cfg.loss_agg)
    metrics.update(value_loss=_item(loss), value_mean=_masked_mean(v, mask))
    return loss, metrics


def ppo_loss(inp: PolicyInputs, cfg: LossConfig,
             norm: LossNorm | None = None) -> tuple[torch.Tensor, Metrics]:
    """PPO-clip on GAE advantages; with a shared critic (value head on the policy's trunk) plus
    value_coef times the clipped value loss. A separate critic trains on `value_loss` alone."""
    critic = _shared_critic_inputs(inp) if cfg.critic == "shared" else None
    norm = norm or LossNorm.local(inp.mask, inp.seq_ids)
    pg_loss, metrics = _clipped_token_objective(inp, cfg, norm)
    reg, reg_metrics = _regularisers(inp, cfg, norm)
    loss = pg_loss + reg
    if critic is not None:
        v_loss, v_metrics = value_loss(*critic, inp.mask, inp.seq_ids, cfg, norm)
        loss = loss + cfg.value_coef * v_loss
        metrics.update(v_metrics)
    metrics.update(reg_metrics)
    return loss, {"loss": _item(loss), **metrics}


def _shared_critic_inputs(inp: PolicyInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """values, old_values and returns: what the value loss of a shared critic needs."""
    if inp.values is None or inp.old_values is None or inp.returns is None:
        raise ValueError("ppo_loss with critic = 'shared' needs values, old_values and returns")
    return inp.values, inp.old_values, inp.returns


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor, norm: LossNorm | None = None,
             mode: str = "token_mean") -> tuple[torch.Tensor, Metrics]:
    """Negative log-likelihood of the masked tokens."""
    norm = norm or LossNorm.local(mask, seq_ids)
    loss = aggregate(-logprobs, mask, seq_ids, norm, mode)
    return loss, {"loss": _item(loss), "nll": _masked_mean(-logprobs, mask)}


POLICY_LOSSES = {"grpo": grpo_loss, "gspo": gspo_loss, "ppo": ppo_loss}
