"""Attention in fp32 inside a bf16 autocast on the CPU.

bf16 autocast makes the CPU trainer's matmuls bf16, which AMX-capable CPUs run several times faster
than fp32 (`bench/trainer_step.py`: the step as a whole ~1.5x at one thread). Autocast also sends
SDPA to bf16, and the CPU's flash-attention *backward* in bf16 is ~2.4x slower than in fp32
(profiled on the default model: 403 vs 169 ms a step), so on the CPU the attention itself runs in
fp32: q, k and v are upcast, the output is cast back to the autocast dtype. On CUDA bf16 SDPA is the
fast one and is left alone.

Packing needs the attention mask built for SDPA (transformers turns restarting `position_ids` into a
block-diagonal mask per attention implementation), so the implementation is registered with
transformers under a name of its own for both the attention and its mask.
"""

from __future__ import annotations

import torch

FP32_SDPA = "rlfleet_sdpa_fp32"
_registered = False


def _sdpa_fp32(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = query.dtype
    with torch.autocast(query.device.type, enabled=False):
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(),
                                              attention_mask, **kwargs)
    return out.to(dtype), weights


def register() -> str:
    """Registers the fp32 SDPA with transformers (once per process); its name for `attn_implementation`."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask

        AttentionInterface.register(FP32_SDPA, _sdpa_fp32)
        AttentionMaskInterface.register(FP32_SDPA, sdpa_mask)
        _registered = True
    return FP32_SDPA


def implementation(attn_implementation: str, bf16: bool, device: str) -> str:
    """The attention the model is built with: the configured one, or its fp32 variant where bf16
    autocast would make the CPU's attention slower."""
    if bf16 and device == "cpu" and attn_implementation == "sdpa":
        return register()
    return attn_implementation
