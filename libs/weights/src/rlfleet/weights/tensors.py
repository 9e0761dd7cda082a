"""Tensors in their served dtype, as raw bytes in numpy arrays.

The store never needs torch: a bf16 tensor is a ``uint16`` array of its bit
patterns, an fp32 tensor a ``float32`` array, and ``ServedTensors`` carries
each tensor's safetensors dtype name alongside. Torch state dicts are
converted by ``rlfleet.weights.torch_io``, imported only when one is passed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

# safetensors dtype name -> numpy dtype holding the same bytes. Types numpy
# lacks (bf16, fp8) are carried as unsigned ints of the same width.
STORAGE_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "F8_E4M3": np.dtype(np.uint8),
    "F8_E5M2": np.dtype(np.uint8),
    "I16": np.dtype(np.int16),
    "U16": np.dtype(np.uint16),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(np.uint16),
    "I32": np.dtype(np.int32),
    "U32": np.dtype(np.uint32),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64),
    "U64": np.dtype(np.uint64),
}
_NUMPY_TO_NAME = {
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.uint8): "U8",
    np.dtype(np.int8): "I8",
    np.dtype(np.int16): "I16",
    np.dtype(np.uint16): "U16",
    np.dtype(np.float16): "F16",
    np.dtype(np.int32): "I32",
    np.dtype(np.uint32): "U32",
    np.dtype(np.float32): "F32",
    np.dtype(np.float64): "F64",
    np.dtype(np.int64): "I64",
    np.dtype(np.uint64): "U64",
}
FLOAT_NAMES = frozenset({"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"})
SERVED_DTYPES = {
    "bf16": "BF16",
    "bfloat16": "BF16",
    "fp32": "F32",
    "float32": "F32",
    "fp16": "F16",
    "float16": "F16",
}


def served_dtype_name(name: str) -> str:
    """Normalise a user-facing dtype ("bf16", "fp32", "BF16"...) to a safetensors name."""
    if name in STORAGE_DTYPES and name in FLOAT_NAMES:
        return name
    try:
        return SERVED_DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unsupported served dtype {name!r}; use bf16, fp16 or fp32") from None


def uint_view(arr: np.ndarray) -> np.ndarray:
    """The flat unsigned-int view of a contiguous array (same memory): byte
    comparison and XOR work on it whatever the element type."""
    if not arr.flags.c_contiguous:
        raise ValueError("tensor is not contiguous; cannot take a byte view")
    return arr.reshape(-1).view(np.dtype(f"u{arr.dtype.itemsize}"))


def fp32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bf16 bit patterns exactly as torch's CPU cast does (round
    to nearest even; every NaN becomes 0xFFFF, as its vectorised kernel writes),
    so a numpy trainer and a torch trainer publish the same bytes."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    out = ((u + (((u >> 16) & 1) + np.uint32(0x7FFF))) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0xFFFF
    return out


def bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


class ServedTensors(Mapping[str, np.ndarray]):
    """Name -> C-contiguous array of the tensor's served bytes, plus dtype names.

    ``arrays[name]`` is writable when the caller owns it, which is what the
    in-place delta apply needs (an engine passes views of its own parameters).
    """

    def __init__(
        self,
        arrays: Mapping[str, np.ndarray],
        dtypes: Mapping[str, str],
        aliases: Mapping[str, str] | None = None,
    ) -> None:
        missing = set(arrays) ^ set(dtypes)
        if missing:
            raise ValueError(f"arrays and dtypes name different tensors: {sorted(missing)[:5]}")
        for name, arr in arrays.items():
            want = STORAGE_DTYPES[dtypes[name]]
            if arr.dtype.itemsize != want.itemsize:
                raise ValueError(f"{name}: {arr.dtype} cannot hold {dtypes[name]}")
        self.arrays = dict(arrays)
        self.dtypes = dict(dtypes)
        # Tied weights (lm_head.weight -> model.embed_tokens.weight) are stored
        # once, as HF does; the alias names are kept so loaders can re-tie them.
        self.aliases = dict(aliases or {})

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.arrays)

    def __len__(self) -> int:
        return len(self.arrays)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def copy(self) -> ServedTensors:
        return ServedTensors({k: v.copy() for k, v in self.arrays.items()}, self.dtypes, self.aliases)

    def layout(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {k: (self.dtypes[k], tuple(v.shape)) for k, v in self.arrays.items()}

    def to_float32(self, name: str) -> np.ndarray:
        """Decode one tensor to float32 (for humans and tests; lossless for bf16/fp16)."""
        arr, dt = self.arrays[name], self.dtypes[name]
        if dt == "BF16":
            return bf16_bits_to_fp32(arr)
        return arr.astype(np.float32)


def is_torch_tensor(value: Any) -> bool:
    # Checked by module name so that this module never imports torch.
    return type(value).__module__.startswith("torch")


def numpy_to_served(tensors: Mapping[str, Any], served: str) -> ServedTensors:
    """`to_served` (convert.py) for numpy arrays: floating ones cast to `served` (a
    `served_dtype_name`), the others kept; always fresh arrays."""
    arrays: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    for name, value in tensors.items():
        arr = np.asarray(value)
        if arr.dtype.kind == "f":
            if served == "BF16":
                arr = fp32_to_bf16_bits(arr.astype(np.float32, copy=False))
            else:
                arr = arr.astype(STORAGE_DTYPES[served], copy=True)
            dtypes[name] = served
        else:
            if arr.dtype not in _NUMPY_TO_NAME:
                raise ValueError(f"{name}: unsupported dtype {arr.dtype}")
            dtypes[name] = _NUMPY_TO_NAME[arr.dtype]
            arr = arr.copy()
        arrays[name] = np.ascontiguousarray(arr)
    return ServedTensors(arrays, dtypes)
