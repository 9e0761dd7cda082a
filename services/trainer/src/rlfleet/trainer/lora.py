"""LoRA on the torch backend (peft): wrapping the LM, and the adapter and merged views of its state.

peft's `get_peft_model` freezes every base parameter and injects `lora_A` / `lora_B` into the target
Linear modules, so the optimizer (built from the parameters that require grad) holds the adapter
only. Everything here works on *full state dicts* (`get_model_state_dict(..., full_state_dict=True)`,
keys `lm.base_model.model.<hf name>`), never on modules, so it is the same under FSDP2 at any world
size as in one process.

Two views of the trained policy:
- the adapter, in peft's own file format (the names `save_pretrained` writes:
  `base_model.model.<module>.lora_A.weight`), which SGLang's LoRA loader and rlfleet's CPU engine
  read, with its adapter_config.json;
- the merged model, HF-named, W + (alpha / r) * B @ A per target module: what `merge_and_unload()`
  gives, for consumers that want a plain model (the tests compare the two).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch

from rlfleet.trainer.config import LoraConfig

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

ADAPTER_NAME = "default"  # peft's name for the one adapter; not part of its saved file names
PEFT_PREFIX = "base_model.model."  # what PeftModelForCausalLM puts before the HF names


def wrap(lm: PreTrainedModel, cfg: LoraConfig, base_name: str = "") -> PeftModel:
    """The LM with a fresh adapter (lora_B = 0: the wrapped model computes exactly the base model)."""
    import peft

    config = peft.LoraConfig(**cfg.peft_config(), base_model_name_or_path=base_name or None)
    try:
        return peft.get_peft_model(lm, config)
    except ValueError as exc:  # e.g. no module matches target_modules
        raise ValueError(f"[trainer.lora]: peft cannot wrap this model: {exc}") from None


def is_adapter_key(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def adapter_tensors(full: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's saved names (the adapter name dropped), from a full state
    dict whose LM keys start with `prefix` (e.g. "lm.")."""
    out = {}
    for key, value in full.items():
        if key.startswith(prefix) and is_adapter_key(key):
            name = key[len(prefix):].replace(f".{ADAPTER_NAME}.", ".")
            out[name] = value.detach().to("cpu").contiguous().clone()
    return out


def merged_tensors(full: dict[str, torch.Tensor], prefix: str, cfg: LoraConfig) -> dict[str, torch.Tensor]:
    """HF-named weights with every adapter merged in (fp32 arithmetic, as merge_and_unload does)."""
    inner = prefix + PEFT_PREFIX
    scaling = cfg.alpha / cfg.rank
    out: dict[str, torch.Tensor] = {}
    for key, value in full.items():
        if not key.startswith(inner) or is_adapter_key(key):
            continue
        name = key[len(inner):]
        if ".base_layer." not in name:
            out[name] = value.detach().to("cpu").contiguous().clone()
            continue
        module = name[:name.index(".base_layer.")]
        name = name.replace(".base_layer.", ".")
        weight = value.detach().to("cpu", torch.float32)
        if name == f"{module}.weight":
            a = full[f"{inner}{module}.lora_A.{ADAPTER_NAME}.weight"].detach().to("cpu", torch.float32)
            b = full[f"{inner}{module}.lora_B.{ADAPTER_NAME}.weight"].detach().to("cpu", torch.float32)
            weight = weight + scaling * (b @ a)
        out[name] = weight.to(value.dtype).contiguous()
    return out


def base_tensors(full: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """HF-named frozen base weights (what the adapter applies to)."""
    inner = prefix + PEFT_PREFIX
    return {key[len(inner):].replace(".base_layer.", "."): value.detach().to("cpu").contiguous().clone()
            for key, value in full.items() if key.startswith(inner) and not is_adapter_key(key)}


def adapter_config(lm: PeftModel) -> dict[str, Any]:
    """adapter_config.json as peft's save_pretrained writes it (sets as sorted lists)."""
    config = lm.peft_config[ADAPTER_NAME].to_dict()
    return json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))
