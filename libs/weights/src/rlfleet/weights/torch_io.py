"""Torch adapters, imported lazily: only trainers and engines holding torch
tensors load this module (and torch); the store itself works on numpy."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from rlfleet.weights.tensors import ServedTensors

_TORCH_TO_NAME = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
}
_NAME_TO_TORCH = {v: k for k, v in _TORCH_TO_NAME.items()}
_SERVED_TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
# numpy cannot hold bf16: move its bits through int16 (same width, same bytes).
_BITS = {torch.bfloat16: (torch.int16, np.uint16)}


def _storage_key(t: torch.Tensor) -> tuple[int, int | torch.SymInt, tuple[int, ...], tuple[int, ...]]:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def _unique(sd: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Drop tied duplicates (lm_head.weight sharing embed_tokens' storage), as HF
    does when saving; returns (unique tensors, alias -> kept name)."""
    seen: dict[tuple, str] = {}
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in sd.items():
        key = _storage_key(t)
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        unique[name] = t
    return unique, aliases


def _numpy_bits(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor's bytes (shares memory)."""
    if t.dtype in _BITS:
        torch_int, np_uint = _BITS[t.dtype]
        return t.view(torch_int).numpy().view(np_uint)
    return t.numpy()


def state_dict_to_served(sd: Mapping[str, torch.Tensor], served: str) -> ServedTensors:
    """Trainer tensors -> served bytes: floating tensors rounded to ``served``
    by torch itself (round to nearest even), copied off the trainer's memory."""
    unique, aliases = _unique(sd)
    arrays: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    with torch.no_grad():
        for name, t in unique.items():
            t = t.detach()
            if t.is_floating_point():
                t = t.to(device="cpu", dtype=_SERVED_TORCH[served])
                dtypes[name] = served
            else:
                t = t.to("cpu")
                dtypes[name] = _TORCH_TO_NAME[t.dtype]
            # .to() may return the trainer's own tensor: always copy.
            arrays[name] = _numpy_bits(t.contiguous()).copy()
    return ServedTensors(arrays, dtypes, aliases)


def byte_view(t: torch.Tensor) -> np.ndarray:
    """The engine's parameter as a writable numpy view of its bytes, for
    ``apply_delta`` to write in place. CPU only: a GPU engine decodes here and
    copies per-tensor results to the device (or uses the distributed transport)."""
    if t.device.type != "cpu":
        raise ValueError(f"in-place apply needs CPU tensors, got {t.device}")
    if not t.is_contiguous():
        raise ValueError("in-place apply needs contiguous tensors")
    return _numpy_bits(t.detach())


def byte_views(module_or_sd: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Name -> writable byte view of each unique parameter/buffer of an engine's model."""
    sd = (
        module_or_sd.state_dict(keep_vars=True) if isinstance(module_or_sd, torch.nn.Module) else module_or_sd
    )
    unique, _ = _unique(sd)
    return {name: byte_view(t) for name, t in unique.items()}


def to_torch(tensors: ServedTensors) -> dict[str, torch.Tensor]:
    """Served bytes -> torch tensors in the served dtype (sharing the arrays' memory),
    aliases included so ``load_state_dict`` sees tied names."""
    out: dict[str, torch.Tensor] = {}
    for name, arr in tensors.items():
        dt = _NAME_TO_TORCH[tensors.dtypes[name]]
        if dt in _BITS:
            out[name] = torch.from_numpy(arr.view(np.int16)).view(dt)
        else:
            out[name] = torch.from_numpy(arr)
    for alias, target in tensors.aliases.items():
        out[alias] = out[target]
    return out


def copy_into(module: torch.nn.Module, tensors: ServedTensors) -> None:
    """Overwrite a model's parameters with ``tensors`` (a full reload)."""
    params = module.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, t in to_torch(tensors).items():
            if name in params:
                params[name].copy_(t)
