"""What a trainer sends an engine directly (broadcast, P2P, same-node tensors), and how both sides
check it arrived whole.

Every trainer-sent transport ships the same tensors: the trainer's state dict with tied tensors
once (lm_head sharing embed_tokens: the engine's copy is tied too), floating tensors cast to the
served dtype (bf16: the bytes the weight store serves, so an engine updated directly and one
updated from the store hold identical weights). Each tensor's checksum is of those bytes, in memory
order; the engine hashes what it received the same way, so a partial, interrupted or corrupted
transfer is caught by comparing two dicts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from rlfleet.weights.codec import checksum
from rlfleet.weights.sent_checks import DEFAULT_ALGORITHM, mismatched

__all__ = ["DEFAULT_ALGORITHM", "mismatched", "nbytes", "served_named", "tensor_checksums"]


def served_named(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                 dtype: str | None = "bfloat16") -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) in order, tied tensors once, floating ones cast to `dtype`; left on their device."""
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    cast = getattr(torch, dtype) if dtype else None
    seen: set[tuple[int, int | torch.SymInt, tuple[int, ...]]] = set()
    out = []
    for name, t in items:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        t = t.detach()
        if cast is not None and t.is_floating_point():
            t = t.to(cast)
        out.append((name, t.contiguous()))
    return out


def _bytes_of(t: torch.Tensor):
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()  # hashing reads host memory; the tensor itself travels from where it is
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def tensor_checksums(named: Iterable[tuple[str, torch.Tensor]],
                     algorithm: str = DEFAULT_ALGORITHM) -> dict[str, str]:
    return {name: checksum(_bytes_of(t), algorithm) for name, t in named}


def nbytes(named: Iterable[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)
