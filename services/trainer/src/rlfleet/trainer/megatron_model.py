"""The policy as a Megatron-core GPTModel: built from an HF directory by megatron-bridge, run on
one micro-batch, and exported back to HF names.

The model is tensor-parallel over the TP group (`parallel_state`): attention heads and MLP columns
are split across ranks, and the output layer is split over the vocabulary. Log-probs and entropy
are therefore computed vocab-parallel (Megatron's own `vocab_parallel_cross_entropy`, and a
vocab-parallel entropy below), never gathering the full [rows, length, vocab] logits on one rank;
at TP 1 both are the plain log-softmax quantities of losses.py.

Packed rows hold several sequences; the local (non-TE) attention gets an explicit block-diagonal
causal mask built from the position ids (which restart at 0 for every sequence and every run of
padding), so a sequence never attends to its neighbour. Megatron's rotary embedding uses the
column index as position: inside one sequence the relative positions, which are all RoPE
attention depends on, are the same as with HF's restarting position ids.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rlfleet.trainer import megatron_cpu

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

# HF architectures megatron-bridge 0.3.1 converts and that this backend is tested with.
SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM")


class UnsupportedModelError(ValueError):
    """The HF directory holds a model this backend cannot convert."""


@dataclass
class BuiltPolicy:
    bridge: Any  # megatron.bridge.AutoBridge
    model: GPTModel  # unwrapped
    hf_config: Any  # transformers.PretrainedConfig of the source


def _check_supported(model_dir: str) -> None:
    import json

    config = json.loads((Path(model_dir) / "config.json").read_text())
    architectures = config.get("architectures") or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in architectures):
        raise UnsupportedModelError(f"{model_dir}: architectures {architectures} are not among the "
                                    f"Megatron backend's {list(SUPPORTED_ARCHITECTURES)}; "
                                    "use backend.name = \"torch\"")


def configure_provider(provider: Any, tensor_parallel: int, bf16: bool, on_cuda: bool) -> None:
    """Parallel layout and numerics of the GPTModel the bridge's provider builds."""
    from megatron.bridge.models.gpt_provider import local_layer_spec

    provider.tensor_model_parallel_size = tensor_parallel
    provider.pipeline_model_parallel_size = 1
    provider.context_parallel_size = 1
    provider.sequence_parallel = False
    provider.bf16, provider.fp16 = bf16, False
    provider.params_dtype = torch.bfloat16 if bf16 else torch.float32
    provider.pipeline_dtype = provider.params_dtype
    # Dropout would make the trainer's log-probs random; RL trainers run the policy without it.
    provider.hidden_dropout = provider.attention_dropout = 0.0
    if not on_cuda:
        # Local (torch) layers and no fused kernels: the CPU has no TE, Apex or CUDA fusions.
        provider.transformer_layer_spec = local_layer_spec
        provider.use_cpu_initialization = True
        provider.gradient_accumulation_fusion = False
        provider.bias_activation_fusion = provider.bias_dropout_fusion = False
        provider.masked_softmax_fusion = provider.persist_layer_norm = False
        provider.apply_rope_fusion = provider.cross_entropy_loss_fusion = False


def build_policy(model_dir: str, tensor_parallel: int, bf16: bool, on_cuda: bool) -> BuiltPolicy:
    """HF directory -> GPTModel with the HF weights (this rank's TP shard). Collective over the TP group."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    _check_supported(model_dir)
    megatron_cpu.apply()
    bridge = megatron_cpu.import_bridge().from_hf_pretrained(model_dir, dtype=torch.float32)
    provider = bridge.to_megatron_provider(load_weights=False)
    configure_provider(provider, tensor_parallel, bf16, on_cuda)
    provider.finalize()
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    model = provider.provide()
    if on_cuda:
        model = model.cuda(torch.cuda.current_device())
    bridge.load_hf_weights([model])
    vocab = int(bridge.hf_pretrained.config.vocab_size)
    if model.output_layer.output_size_per_partition * tensor_parallel != vocab:
        raise UnsupportedModelError(f"{model_dir}: vocab {vocab} is not split evenly over {tensor_parallel} "
                                    "tensor-parallel ranks without padding")
    return BuiltPolicy(bridge=bridge, model=model, hf_config=bridge.hf_pretrained.config)


def export_hf_state_dict(policy: BuiltPolicy) -> dict[str, torch.Tensor]:
    """Full HF-named fp32 tensors on CPU (every rank of the TP group gets them: collective).
    Parameters the HF model does not have (the value head) are left out."""
    bridge_log = logging.getLogger("megatron.bridge.models.conversion.model_bridge")
    level = bridge_log.level
    bridge_log.setLevel(logging.ERROR)  # "No mapping found for megatron_param: value_head.weight"
    try:
        tasks = [t for t in policy.bridge.get_conversion_tasks([policy.model]) if t is not None]
    finally:
        bridge_log.setLevel(level)
    weights = policy.bridge.export_hf_weights([policy.model], cpu=True, show_progress=False,
                                              conversion_tasks=tasks)
    # Copies: at TP 1 the bridge hands out the parameters themselves, which the next step changes.
    out = {name: tensor.detach().to("cpu", torch.float32, copy=True).contiguous() for name, tensor in weights}
    if getattr(policy.hf_config, "tie_word_embeddings", False):
        out.pop("lm_head.weight", None)  # stored once, as HF does
    return out


# ---------------------------------------------------------------- one micro-batch


def attention_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[R, 1, L, L] bool, True where attention is *not* allowed (Megatron's convention):
    causal within each run of positions that starts at 0, nothing across runs."""
    segment = (position_ids == 0).cumsum(dim=-1)
    same = segment[:, :, None] == segment[:, None, :]
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return ~(same & causal)[:, None]


def vocab_parallel_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Aligned log p(input_ids[t] | < t) from this rank's vocab shard of the logits [R, L, V/tp];
    position 0 gets 0 (as losses.logprobs_from_logits)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    # The cross entropy works in place on its input: give it its own fp32 copy.
    shifted = logits[:, :-1].to(torch.float32, copy=True)
    nll = vocab_parallel_cross_entropy(shifted, input_ids[:, 1:].contiguous())
    return nn.functional.pad(-nll, (1, 0))


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Aligned entropy of the distribution that predicted token t from the vocab-sharded logits;
    position 0 gets 0 (as losses.entropy_from_logits). H = log S - sum_v e_v (z_v - m) / S."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    z = logits[:, :-1].float()
    top = z.detach().amax(dim=-1, keepdim=True)
    group = parallel_state.get_tensor_model_parallel_group()
    if group.size() > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    centred = z - top
    e = centred.exp()
    # Forward: sum over the TP ranks; backward: each rank's share gets the full gradient.
    total = reduce_from_tensor_model_parallel_region(e.sum(dim=-1))
    weighted = reduce_from_tensor_model_parallel_region((e * centred).sum(dim=-1))
    return nn.functional.pad(total.log() - weighted / total, (1, 0))


class HiddenStates:
    """Captures the final hidden state (the output layer's input) for the value head."""

    def __init__(self, model: GPTModel) -> None:
        self.last: torch.Tensor | None = None
        model.output_layer.register_forward_pre_hook(self._keep)

    def _keep(self, module: nn.Module, args: tuple) -> None:
        self.last = args[0]  # [L, R, H]: Megatron is sequence-first

    def take(self) -> torch.Tensor:
        hidden, self.last = self.last, None
        if hidden is None:
            raise RuntimeError("no hidden state captured: the output layer did not run")
        return hidden.transpose(0, 1)
