"""Glue between batches, backends and the pure losses: advantage preparation and the loss callables.

`rl_step` is the whole learning step of the RL loop, as the trainer service runs it per batch of
complete groups:

    batch = assemble_batch(samples)                      # exact tokens, packed
    values = backend.compute_values(batch)               # PPO, shared critic: values before the update
    values = value_model.values(batch)                   # PPO, separate critic
    batch = with_advantages(batch, loss_cfg, values)     # group-normalised or GAE
    batch.ref_logprobs = reference.compute_logprobs(...) # only with a KL penalty
    metrics = backend.train_step(batch, RLObjective(loss_cfg))
    metrics |= value_model.train_step(batch, loss_cfg)   # PPO, separate critic: its own optimizer step
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlfleet.trainer.backend import ModelOutputs, TrainingBackend
from rlfleet.trainer.batching import TrainBatch, TrainSample, assemble_batch
from rlfleet.trainer.config import BatchConfig, LossConfig
from rlfleet.trainer.losses import (
    POLICY_LOSSES,
    LossNorm,
    Metrics,
    PolicyInputs,
    gae_advantages,
    group_advantages,
    sft_loss,
    terminal_rewards,
    whiten,
)
from rlfleet.trainer.value_model import ValueModel


class RLObjective:
    """The configured policy loss (GRPO, GSPO or PPO) as a backend `LossFn`."""

    def __init__(self, cfg: LossConfig, old_is_current: bool = False) -> None:
        self.cfg = cfg
        self.loss = POLICY_LOSSES[cfg.algorithm]
        self.needs_values = cfg.algorithm == "ppo" and cfg.critic == "shared"
        self.needs_entropy_grad = cfg.entropy_coef > 0
        # One optimizer step per batch: the proximal policy (the trainer's log-probs before the update)
        # is this very forward pass, detached, so a separate no-grad pass over the batch is not needed.
        self.old_is_current = old_is_current

    def __call__(self, out: ModelOutputs, batch: TrainBatch, norm: LossNorm) -> tuple[torch.Tensor, Metrics]:
        if batch.advantages is None:
            raise ValueError("batch has no advantages; call with_advantages first")
        inputs = PolicyInputs(
            logprobs=out.logprobs,
            # Without a recomputation the rollout's log-probs are the proximal policy (TIS is then 1).
            old_logprobs=self._old_logprobs(out, batch),
            rollout_logprobs=batch.rollout_logprobs,
            advantages=batch.advantages,
            mask=batch.loss_mask,
            seq_ids=batch.seq_ids,
            ref_logprobs=batch.ref_logprobs,
            entropy=out.entropy,
            values=out.values,
            old_values=batch.old_values,
            returns=batch.returns,
        )
        return self.loss(inputs, self.cfg, norm)

    def _old_logprobs(self, out: ModelOutputs, batch: TrainBatch) -> torch.Tensor:
        if batch.old_logprobs is not None:
            return batch.old_logprobs
        if self.old_is_current:
            return out.logprobs.detach()
        return batch.rollout_logprobs


class SFTObjective:
    needs_values = False
    needs_entropy_grad = False

    def __init__(self, mode: str = "token_mean") -> None:
        self.mode = mode

    def __call__(self, out: ModelOutputs, batch: TrainBatch, norm: LossNorm) -> tuple[torch.Tensor, Metrics]:
        loss, metrics = sft_loss(out.logprobs, batch.loss_mask, batch.seq_ids, norm, self.mode)
        if out.entropy is not None:
            mask = batch.loss_mask
            metrics["entropy"] = float((out.entropy * mask).sum() / mask.sum().clamp(min=1))
        return loss, metrics


def with_advantages(batch: TrainBatch, cfg: LossConfig, values: torch.Tensor | None = None) -> TrainBatch:
    """Per-token advantages: group-normalised rewards (GRPO/GSPO) or GAE on `values` (PPO)."""
    if cfg.algorithm == "ppo":
        if values is None:
            raise ValueError("PPO advantages need the critic's values")
        rewards = terminal_rewards(batch.rewards, batch.loss_mask, batch.seq_ids)
        adv, returns = gae_advantages(rewards, values, batch.loss_mask, batch.seq_ids,
                                      cfg.gamma, cfg.gae_lambda)
        if cfg.whiten_advantages:
            adv = whiten(adv, batch.loss_mask)
        return batch.replace(advantages=adv, old_values=values * batch.loss_mask, returns=returns)
    per_seq = group_advantages(batch.rewards, batch.group_ids, cfg.std_normalize, cfg.adv_eps)
    return batch.replace(advantages=batch.per_token(per_seq))


def rl_step(backend: TrainingBackend, samples: Sequence[TrainSample], loss_cfg: LossConfig,
            batch_cfg: BatchConfig, reference: TrainingBackend | None = None,
            recompute_old_logprobs: bool = True, value_model: ValueModel | None = None) -> Metrics:
    """One optimizer step of the RL loop on complete groups of samples (and one of the critic's,
    for PPO with a separate critic: both on the values from before either update)."""
    batch = assemble_batch(samples, batch_cfg.layout, batch_cfg.pack_length, batch_cfg.pad_token_id)
    ppo = loss_cfg.algorithm == "ppo"
    separate = ppo and loss_cfg.critic == "separate"
    if separate and value_model is None:
        raise ValueError("PPO with critic = 'separate' needs a value model")
    critic = value_model if separate else None
    # `train_step` is one optimizer step (micro-batches accumulate), so the log-probs before the update
    # are those of its own forward pass (or the rollout's, which the trajectory carries); only a shared
    # critic's values need a pass of their own first, and that pass needs no LM head.
    values = None
    if critic is not None:
        values = critic.values(batch)
    elif ppo:
        values = backend.compute_values(batch)
    batch = with_advantages(batch, loss_cfg, values)
    if reference is not None:
        batch = batch.replace(ref_logprobs=reference.compute_logprobs(batch))
    metrics = backend.train_step(batch, RLObjective(loss_cfg, old_is_current=recompute_old_logprobs))
    if critic is not None:
        metrics.update(critic.train_step(batch, loss_cfg))
    versions = batch.policy_versions.float()
    metrics.update(reward_mean=float(batch.rewards.mean()), policy_version_min=float(versions.min()))
    return metrics
