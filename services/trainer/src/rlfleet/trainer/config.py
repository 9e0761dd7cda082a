"""Typed configuration of the learning core: the loss, batch assembly and the torch backend.

Importable without torch so that the trainer service can parse and print its config (``--help``,
``--dry-run``) before loading anything heavy. The service's config (service_config.py) nests these.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rlfleet.common.config import StrictModel

# Defaults that differ by algorithm; a value the user sets always wins. GSPO clips a sequence
# ratio (the geometric mean of token ratios), which stays much closer to 1 than a token ratio: the
# paper's clip is 3e-4 / 4e-4, where 0.2 would clip almost nothing; its loss averages per sequence.
ALGORITHM_DEFAULTS: dict[str, dict[str, Any]] = {
    "grpo": {"clip_eps_low": 0.2, "clip_eps_high": 0.2, "loss_agg": "token_mean"},
    "gspo": {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4, "loss_agg": "seq_mean"},
    "ppo": {"clip_eps_low": 0.2, "clip_eps_high": 0.2, "loss_agg": "token_mean"},
}


class LossConfig(StrictModel):
    """The RL objective. Defaults are GRPO with token-level averaging (DAPO's token-mean) and TIS on;
    `clip_eps_low`, `clip_eps_high` and `loss_agg` default per algorithm (ALGORITHM_DEFAULTS)."""

    algorithm: Literal["grpo", "gspo", "ppo"] = Field(
        "grpo", description="grpo: token-level clipped ratio with group-normalised advantages; "
        "gspo: sequence-level ratio (geometric mean of token ratios), clipped per sequence; "
        "ppo: token-level clipped ratio with GAE advantages from a critic (see `critic`).")
    critic: Literal["separate", "shared"] = Field(
        "separate", description="PPO: separate: a value model with its own weights (initialised from the "
        "policy's, or [value_model] model_path), optimizer and checkpoint, as verl, OpenRLHF and slime train "
        "it; shared: a linear value head on the policy's own trunk, trained with the policy's loss "
        "(value_coef weighs it; the only choice with the Megatron backend)")
    clip_eps_low: float = Field(0.2, ge=0.0, description="ratio is clipped below at 1 - clip_eps_low "
                                "(default 0.2; gspo: 3e-4, the GSPO paper's sequence-ratio clip).")
    clip_eps_high: float = Field(0.2, ge=0.0, description="ratio is clipped above at 1 + clip_eps_high "
                                 "(default 0.2, DAPO's clip-higher uses e.g. 0.28; gspo: 4e-4).")
    loss_agg: Literal["token_mean", "seq_mean"] = Field(
        "token_mean", description="token_mean: average over all loss tokens of the batch (default); "
        "seq_mean: average over each sequence's loss tokens, then over sequences (gspo's default).")
    std_normalize: bool = Field(True, description="divide group-centred rewards by the group std "
                                "(False gives Dr.GRPO-style advantages r - mean).")
    adv_eps: float = Field(1e-6, gt=0.0, description="added to the group std before dividing.")
    kl_coef: float = Field(0.0, ge=0.0, description="weight of the k3 KL penalty to the reference policy "
                           "(needs ref_logprobs in the batch when > 0).")
    entropy_coef: float = Field(0.0, ge=0.0, description="weight of an entropy bonus (0 = metric only).")
    tis_cap: float | None = Field(2.0, gt=0.0, description="truncated importance sampling cap C: each token "
                                  "is weighted by min(exp(old_logprob - rollout_logprob), "
                                  "C); None disables TIS.")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="PPO: discount per generated token.")
    gae_lambda: float = Field(0.95, ge=0.0, le=1.0, description="PPO: GAE lambda.")
    value_clip: float | None = Field(0.2, gt=0.0, description="PPO: value predictions are clipped to "
                                     "old_value +- value_clip in the value loss; None disables.")
    value_coef: float = Field(0.5, ge=0.0, description="PPO, critic = shared: weight of the value loss in "
                              "the policy's loss (a separate critic minimises the value loss alone).")
    whiten_advantages: bool = Field(True, description="PPO: normalise GAE advantages over the batch's "
                                    "loss tokens (mean 0, std 1).")

    @model_validator(mode="before")
    @classmethod
    def _algorithm_defaults(cls, data: Any) -> Any:
        """Fills the fields the user left unset with the algorithm's defaults (explicit values win)."""
        if not isinstance(data, dict):
            return data
        defaults = ALGORITHM_DEFAULTS.get(data.get("algorithm", "grpo"))
        if not defaults:
            return data  # an unknown algorithm: the Literal reports it
        return {**defaults, **data}


class BatchConfig(StrictModel):
    """How samples become model inputs."""

    layout: Literal["packed", "padded"] = Field(
        "packed", description="packed: whole sequences concatenated into rows with position ids restarting "
        "at 0 (block-diagonal attention, no compute on padding); padded: one right-padded row per sequence.")
    pack_length: int | None = Field(None, ge=1, description="packed: maximum tokens per row (a longer "
                                    "sequence gets a row of its own); None: the batch's longest sequence, "
                                    "fastest with eager/sdpa attention whose cost grows with the "
                                    "square of the row length.")
    micro_batch_rows: int = Field(4, ge=1, description="rows per forward/backward; gradients are accumulated "
                                  "over a rank's micro-batches before one optimizer step.")
    pad_token_id: int = Field(0, ge=0,
                              description="token id written into padding (never attended, never scored).")


class OptimConfig(StrictModel):
    lr: float = Field(1e-6, gt=0.0, description="peak learning rate.")
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0)
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="clip the global grad norm; None disables.")
    schedule: Literal["constant", "cosine"] = Field(
        "constant",
        description="constant (after warmup) or cosine decay to min_lr_ratio * lr at total_steps.")
    warmup_steps: int = Field(0, ge=0, description="linear warmup from lr / warmup_steps to lr.")
    total_steps: int = Field(1000, ge=1, description="cosine: the step at which the decay ends.")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)


class MegatronConfig(StrictModel):
    """The Megatron-core backend's parallel layout (the model and numerics are the backend's, see
    TorchBackendConfig: model_dir, device, bf16, seed, optim, batch)."""

    tensor_parallel: int = Field(
        1, ge=1, description="tensor-parallel size: each layer is split over this many ranks; the world "
        "size (torchrun's ranks) must be a multiple of it, and the rest is data parallel "
        "(world = tensor_parallel x data parallel)")
    distributed_optimizer: bool = Field(
        True, description="cuda: Megatron's DDP and distributed optimizer (fp32 main weights and Adam "
        "state sharded over data-parallel ranks); cpu: not available, torch AdamW on each rank's shard")


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(StrictModel):
    """A LoRA adapter trained in place of the policy's weights (peft): the base model stays frozen
    and bit-identical, the optimizer holds the adapter's parameters only, checkpoints hold the
    adapter and its optimizer state, and each published version is an adapter on the base version."""

    enabled: bool = Field(False,
                          description="train a LoRA adapter instead of the full model (torch backend only)")
    rank: int = Field(8, ge=1, description="LoRA rank r")
    alpha: float = Field(16.0, gt=0.0, description="lora_alpha: the update is scaled by alpha / rank (SGLang "
                         "ignores rsLoRA, so rsLoRA is not offered)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0,
                           description="lora_dropout on the adapter's input while training")
    b_lr_ratio: float = Field(
        1.0, ge=1.0, le=64.0,
        description="LoRA+ (Hayou et al. 2024, who suggest 16): lora_B's learning rate is this times "
        "optim.lr, lora_A keeps optim.lr. On calc, 4 and 16 learned faster early and then fell back "
        "(README). 1 = plain LoRA")
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS), min_length=1,
        description="names of the Linear modules that get an adapter (default: all seven attention and MLP "
        "projections of Qwen2/Llama)")

    def peft_config(self) -> dict[str, Any]:
        """The keyword arguments of peft's LoraConfig (also what adapter_config.json records)."""
        return {"r": self.rank, "lora_alpha": self.alpha, "lora_dropout": self.dropout,
                "target_modules": list(self.target_modules), "bias": "none", "task_type": "CAUSAL_LM"}


class BackendOptions(StrictModel):
    """How a backend runs its model, whatever the model is (the service's `backend` section)."""

    attn_implementation: Literal["sdpa", "eager"] = Field("sdpa", description="attention kernel: sdpa, eager")
    device: Literal["cpu", "cuda"] = Field("cpu", description="cuda: one GPU per rank (LOCAL_RANK), NCCL; "
                                           "cpu: gloo.")
    bf16: bool = Field(False, description="bf16 autocast for forward/backward (weights and optimizer stay "
                       "fp32; on the CPU the attention itself runs in fp32, rlfleet.trainer.attention). "
                       "`rlfleet run` turns it on for the torch backend.")
    seed: int = Field(0, description="seed of everything random in the trainer")


class TorchBackendConfig(BackendOptions):
    """The default training backend: a transformers causal LM, AdamW, FSDP2 at world size >= 2."""

    model_dir: str | None = Field(None, description="HF directory (config.json + safetensors) to load.")
    model_config_dict: dict[str, Any] | None = Field(
        None, description="build a model from this config (`model_type` defaults to qwen2; random init with "
        "`seed`) instead of loading model_dir.")
    value_head: bool = Field(False, description="add a scalar value head on the final hidden state (PPO).")
    lora: LoraConfig = Field(default_factory=LoraConfig,
                             description="train a LoRA adapter on the frozen model")
    values_only: bool = Field(False, description="a critic: only the value head's output is computed (no "
                              "LM head, no log-probs); needs value_head")
    optim: OptimConfig = OptimConfig()
    batch: BatchConfig = BatchConfig()

    @model_validator(mode="after")
    def _one_model_source(self) -> TorchBackendConfig:
        if (self.model_dir is None) == (self.model_config_dict is None):
            raise ValueError("set exactly one of model_dir and model_config_dict")
        if self.values_only and not self.value_head:
            raise ValueError("values_only needs value_head")
        return self
