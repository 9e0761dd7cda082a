"""Engine side of a delta: a decoded delta, the in-place swap, and its checks.

The engine calls ``store.fetch_delta(v)`` while still serving (read,
decompress, decode), optionally ``preverify_delta`` (also while serving: it
proves current + delta == the trainer's bytes on a scratch copy, one tensor at
a time), then pauses and calls ``apply_delta`` (in-place writes only). The
weights never change while an engine serves, so a preverified delta needs no
hashing inside the pause; without a preverify the swap hashes every tensor it
wrote before returning.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar

import numpy as np

from rlfleet.weights.codec import DecodedTensor, apply_decoded, checksum
from rlfleet.weights.errors import BaseVersionMismatch, CorruptDelta
from rlfleet.weights.tensors import STORAGE_DTYPES, is_torch_tensor, uint_view

T = TypeVar("T")
R = TypeVar("R")


def parallel_map(fn: Callable[[T], R], items: Iterable[T], workers: int) -> list[R]:
    """Map over threads (zstd, hashlib and numpy copies release the GIL); the
    first exception propagates, as in a plain loop."""
    items = list(items)
    if workers <= 1 or len(items) <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(max_workers=min(workers, len(items))) as pool:
        return list(pool.map(fn, items))


@dataclass
class DecodedDelta:
    """A delta decoded into per-tensor arrays, ready for ``apply_delta``."""

    run_id: str
    version: int
    base_version: int
    checksum_algorithm: str
    tensors: dict[str, DecodedTensor]
    payload_bytes: int  # compressed bytes read from the store
    applied: bool = False
    # name -> (address, nbytes) of the buffers preverify_delta checked
    preverified: dict[str, tuple[int, int]] | None = field(default=None, repr=False)

    @property
    def changed(self) -> dict[str, DecodedTensor]:
        return {k: t for k, t in self.tensors.items() if t.encoding != "none"}

    @property
    def changed_values(self) -> int:
        return sum(t.changed for t in self.tensors.values())

    @property
    def nbytes(self) -> int:
        """Memory held by the decoded arrays."""
        return sum(t.nbytes for t in self.tensors.values())


@dataclass(frozen=True)
class ApplyResult:
    version: int
    tensors_changed: int
    values_changed: int
    verified: str  # "written" | "all" | "preverified" | "none"


def _flat_target(current: Mapping[str, Any], d: DecodedTensor, base_version: int) -> np.ndarray:
    """The writable flat uint view of the engine's tensor ``d.name``."""
    if d.name not in current:
        raise BaseVersionMismatch(base_version, None, f"tensor {d.name!r} missing from current tensors")
    arr = current[d.name]
    if is_torch_tensor(arr):
        from rlfleet.weights import torch_io  # lazy: only engines holding torch tensors pay for it

        arr = torch_io.byte_view(arr)
    numel = int(np.prod(d.shape, dtype=np.int64))
    if arr.dtype.itemsize != STORAGE_DTYPES[d.dtype].itemsize or arr.size != numel:
        raise BaseVersionMismatch(
            base_version,
            None,
            f"{d.name}: current is {arr.dtype}{tuple(arr.shape)}, delta is {d.dtype}{d.shape}",
        )
    return uint_view(arr)


def _address(a: np.ndarray) -> tuple[int, int]:
    return a.__array_interface__["data"][0], a.nbytes


def _targets(
    current: Mapping[str, Any], decoded: DecodedDelta, names: Iterable[str]
) -> dict[str, np.ndarray]:
    targets: dict[str, np.ndarray] = {}
    seen: dict[tuple[int, int], str] = {}
    for name in names:
        t = _flat_target(current, decoded.tensors[name], decoded.base_version)
        addr = _address(t)
        if addr in seen:
            # Two names on one buffer (tied weights handed over twice): write it
            # once, or an xor would be undone. Their entries must agree.
            first = decoded.tensors[seen[addr]]
            if first.checksum != decoded.tensors[name].checksum:
                raise BaseVersionMismatch(
                    decoded.base_version,
                    None,
                    f"{name} and {seen[addr]} share memory but differ in the delta",
                )
            continue
        seen[addr] = name
        targets[name] = t
    return targets


def preverify_delta(
    current: Mapping[str, Any], decoded: DecodedDelta, workers: int = 1, dense_above: float = 0.1
) -> None:
    """Check, without touching ``current``, that applying ``decoded`` gives the
    trainer's bytes: apply to a scratch copy of each changed tensor and hash it.
    Run it before pausing. Raises ``CorruptDelta`` (the delta or the current
    tensors are wrong; nothing was modified).

    The checked result is also restaged as the cheapest swap: the new values at
    the changed positions (one scatter), or, when more than ``dense_above`` of a
    tensor changed, the whole new tensor (one memcpy; a scattered write touches
    most cache lines anyway by then). Both are idempotent. ``apply_delta`` then
    skips hashing in the pause as long as it is handed the same buffers.
    """
    targets = _targets(current, decoded, decoded.changed)

    def check(item: tuple[str, np.ndarray]) -> DecodedTensor:
        name, target = item
        d = decoded.tensors[name]
        scratch = target.copy()
        apply_decoded(scratch, d)
        got = checksum(scratch, decoded.checksum_algorithm)
        if got != d.checksum:
            raise CorruptDelta(
                decoded.version,
                f"current + delta has {decoded.checksum_algorithm} {got[:16]}, "
                f"trainer's is {d.checksum[:16]} (corrupt delta, "
                f"or current tensors are not version {decoded.base_version}); nothing modified",
                tensor=name,
            )
        if d.changed > dense_above * scratch.size:
            return replace(d, encoding="overwrite", positions=None, values=scratch)
        positions = d.positions if d.positions is not None else np.flatnonzero(scratch != target)
        return replace(d, encoding="overwrite", positions=positions, values=scratch[positions])

    staged = parallel_map(check, targets.items(), workers)
    decoded.tensors.update({d.name: d for d in staged})
    decoded.preverified = {name: _address(t) for name, t in targets.items()}


def apply_delta(
    current: Mapping[str, Any],
    decoded: DecodedDelta,
    *,
    current_version: int | None = None,
    verify: Literal["auto", "written", "all", "none"] = "auto",
    workers: int = 1,
) -> ApplyResult:
    """Swap ``current`` (name -> numpy byte views or CPU torch tensors, written
    in place) from ``decoded.base_version`` to ``decoded.version``.

    ``verify``: ``written`` hashes every tensor the delta wrote; ``all`` every
    tensor the delta names (unchanged ones too); ``auto`` is ``written`` unless
    ``preverify_delta`` already checked these same buffers; ``none`` trusts
    the caller. A checksum mismatch raises ``CorruptDelta``: the tensors were
    modified, so the engine must not serve them and should ``recover()``.
    """
    if current_version is not None and current_version != decoded.base_version:
        raise BaseVersionMismatch(decoded.base_version, current_version)
    xor_names = [k for k, t in decoded.tensors.items() if t.encoding == "xor"]
    if decoded.applied and xor_names:
        # An xor applied twice undoes itself; refuse rather than rely on the checksum.
        raise BaseVersionMismatch(
            decoded.base_version, decoded.version, "this xor delta was already applied (apply exactly once)"
        )
    targets = _targets(current, decoded, decoded.changed)
    preverified = decoded.preverified is not None and all(
        decoded.preverified.get(n) == _address(t) for n, t in targets.items()
    )
    parallel_map(lambda item: apply_decoded(item[1], decoded.tensors[item[0]]), targets.items(), workers)
    decoded.applied = True

    mode: str = verify
    if verify == "auto":
        mode = "preverified" if preverified else "written"
    if mode in ("written", "all"):
        to_check = dict(targets)
        if mode == "all":
            to_check.update(_targets(current, decoded, [n for n in decoded.tensors if n not in targets]))

        def check(item: tuple[str, np.ndarray]) -> None:
            name, target = item
            want = decoded.tensors[name].checksum
            got = checksum(target, decoded.checksum_algorithm)
            if got != want:
                raise CorruptDelta(
                    decoded.version,
                    f"{decoded.checksum_algorithm} after apply is {got[:16]}, trainer's is {want[:16]}; "
                    "current tensors were modified and must be reloaded (recover())",
                    tensor=name,
                )

        parallel_map(check, to_check.items(), workers)
    return ApplyResult(decoded.version, len(targets), decoded.changed_values, mode)
