"""Per-tensor delta codec: change detection, xor/overwrite encodings, checksums.

All work is on flat unsigned-int views of the served bytes (bf16 -> uint16),
so "changed" means "a different bit pattern", exactly what the engine must
rewrite. Every payload segment is byte-shuffled (bytes of equal significance
grouped, as blosc does: XOR masks and gaps have mostly-zero high bytes) and
zstd-compressed as its own frame with zstd's content checksum, so a flipped
or truncated byte fails at decompression, before an engine pauses.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import zstandard

CHECKSUM_ALGORITHMS = ("sha256", "blake2b", "crc32")
ENCODINGS = ("xor", "overwrite", "auto")
# The xor encoding's layout by the share of values changed: dense from here on, sparse below.
# bench/weight_delta.py (bf16 deltas of AdamW steps): sparse is 0.6-0.8x dense's bytes below 40%
# changed and 1.05-1.09x above it, so choosing by the count compresses each tensor once (the
# trainer used to compress both layouts of every tensor and keep the smaller) for at most a few
# percent more bytes between 40% and 50%.
XOR_DENSE_FROM = 0.5
# Below this many values both layouts are compressed and the smaller kept: the second frame of the
# sparse layout is a large share of a small tensor's bytes, and compressing a small one twice is cheap.
XOR_BOTH_BELOW = 1 << 16


class DecodeError(Exception):
    """A segment does not decompress or decodes to the wrong size (callers translate it)."""


def checksum(arr: np.ndarray, algorithm: str) -> str:
    """Hex digest of a tensor's bytes, in memory order (C-contiguous)."""
    data = np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data
    if algorithm == "sha256":
        return hashlib.sha256(data).hexdigest()
    if algorithm == "blake2b":
        return hashlib.blake2b(data, digest_size=32).hexdigest()
    if algorithm == "crc32":
        return f"{zlib.crc32(data):08x}"
    raise ValueError(f"unknown checksum algorithm {algorithm!r}; use one of {CHECKSUM_ALGORITHMS}")


def shuffle(u: np.ndarray) -> np.ndarray:
    """Group the bytes of a flat array by significance: all byte 0s, then all byte 1s..."""
    k = u.dtype.itemsize
    if k == 1:
        return u
    return np.ascontiguousarray(u.view(np.uint8).reshape(-1, k).T)


def unshuffle(raw: bytes | bytearray, dtype: np.dtype, n: int) -> np.ndarray:
    k = dtype.itemsize
    planes = np.frombuffer(raw, dtype=np.uint8)
    if planes.size != n * k:
        raise DecodeError(f"decoded {planes.size} bytes, expected {n * k}")
    if k == 1:
        return planes.view(dtype).copy()
    out = np.empty((n, k), dtype=np.uint8)
    out[...] = planes.reshape(k, n).T
    return out.view(dtype).reshape(-1)


def _min_uint(max_value: int) -> np.dtype:
    for t in (np.uint8, np.uint16, np.uint32):
        if max_value <= np.iinfo(t).max:
            return np.dtype(t)
    return np.dtype(np.uint64)


@dataclass
class EncodedTensor:
    """One tensor's entry in a delta: ``segments`` are the compressed payload
    frames; empty when unchanged.

    xor, dense layout: ``xor`` (the XOR mask of every value, zero where unchanged).
    xor, sparse layout: ``positions`` + ``xor`` (the masks at those positions).
    overwrite (sparse): ``positions`` + ``values`` (the new values there).
    """

    encoding: str  # "xor" | "overwrite" | "none"
    changed: int
    numel: int
    layout: str | None = None  # "dense" | "sparse"
    segments: dict[str, bytes] = field(default_factory=dict)
    position_dtype: str | None = None  # uint width of the gap-coded positions

    @property
    def compressed_bytes(self) -> int:
        return sum(len(s) for s in self.segments.values())


def _compressor(level: int) -> zstandard.ZstdCompressor:
    return zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)


def encode_tensor(old: np.ndarray, new: np.ndarray, encoding: str, level: int = 3) -> EncodedTensor:
    """Encode ``new`` against ``old`` (flat uint views of equal dtype and size),
    keeping the smallest candidate the ``encoding`` allows (see ``candidates``)."""
    return min(candidates(old, new, encoding, level), key=lambda c: c.compressed_bytes)


def candidates(old: np.ndarray, new: np.ndarray, encoding: str, level: int = 3) -> list[EncodedTensor]:
    """Every encoding of ``new`` against ``old`` that ``encoding`` allows.

    ``xor`` (apply exactly once) has a dense layout (the whole XOR mask: long
    zero runs, cheap when many values changed) and a sparse one (positions plus
    the masks there: far smaller when few did); it offers the one the share of
    changed values picks (``XOR_DENSE_FROM``), so each tensor is compressed
    once (a small one, ``XOR_BOTH_BELOW``, gets both). ``overwrite`` stores
    positions plus the new values (idempotent; new values carry their full sign
    and exponent, so they compress worse than masks). ``auto`` offers all
    three. Positions are gap-coded: distance to the previous change minus one,
    in the narrowest uint that fits.
    """
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding!r}; use one of {ENCODINGS}")
    x = np.bitwise_xor(old, new)
    positions = np.flatnonzero(x)
    n, changed = int(new.size), int(positions.size)
    if changed == 0:
        return [EncodedTensor("none", 0, n)]
    cctx = _compressor(level)
    both = encoding == "auto" or n < XOR_BOTH_BELOW
    xor_dense = encoding != "overwrite" and (both or changed >= XOR_DENSE_FROM * n)
    xor_sparse = encoding != "overwrite" and (both or not xor_dense)
    out = []
    if xor_dense:
        out.append(EncodedTensor("xor", changed, n, "dense", {"xor": cctx.compress(shuffle(x).data)}))
    if encoding == "xor" and not xor_sparse:
        return out  # no positions needed
    gaps = np.diff(positions, prepend=-1) - 1
    width = _min_uint(int(gaps.max()))
    pos_frame = cctx.compress(shuffle(gaps.astype(width)).data)
    if xor_sparse:
        out.append(
            EncodedTensor(
                "xor",
                changed,
                n,
                "sparse",
                {"positions": pos_frame, "xor": cctx.compress(shuffle(x[positions]).data)},
                width.name,
            )
        )
    if encoding in ("overwrite", "auto"):
        out.append(
            EncodedTensor(
                "overwrite",
                changed,
                n,
                "sparse",
                {"positions": pos_frame, "values": cctx.compress(shuffle(new[positions]).data)},
                width.name,
            )
        )
    return out


@dataclass
class DecodedTensor:
    """A tensor's change, ready to write into the engine's copy.

    ``xor`` with ``positions is None``: ``values`` is the dense XOR mask.
    ``xor`` with positions: ``values`` are the XOR masks at those positions.
    ``overwrite`` with positions: ``values`` are the new values there.
    ``overwrite`` without positions: ``values`` is the whole new tensor (what
    ``preverify_delta`` stages for dense changes: the swap is one memcpy).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    encoding: str
    changed: int
    checksum: str
    positions: np.ndarray | None = None
    values: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.positions, self.values) if a is not None)


def _decompress(frame: bytes | bytearray, expected: int) -> bytes:
    try:
        out = zstandard.ZstdDecompressor().decompress(frame, max_output_size=max(expected, 1))
    except zstandard.ZstdError as e:
        raise DecodeError(f"zstd: {e}") from None
    if len(out) != expected:
        raise DecodeError(f"decompressed {len(out)} bytes, expected {expected}")
    return out


def decode_segments(
    *,
    encoding: str,
    changed: int,
    numel: int,
    uint: np.dtype,
    segments: Mapping[str, bytes | bytearray],
    position_dtype: str | None,
    sparse_below: float = 0.01,
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Decompress and decode one tensor's segments into (positions, values)."""
    if encoding == "none":
        return None, None
    if encoding not in ("xor", "overwrite"):
        raise DecodeError(f"unknown encoding {encoding!r}")
    if encoding == "xor" and "positions" not in segments:
        x = unshuffle(_decompress(segments["xor"], numel * uint.itemsize), uint, numel)
        if changed < sparse_below * numel:
            # Few changes: hand the swap only those, so it touches only them.
            positions = np.flatnonzero(x)
            if positions.size != changed:
                raise DecodeError(f"xor mask has {positions.size} changes, index says {changed}")
            return positions, x[positions]
        return None, x
    if position_dtype not in ("uint8", "uint16", "uint32", "uint64"):
        raise DecodeError(f"bad position dtype {position_dtype!r}")
    pdt = np.dtype(position_dtype)
    gaps = unshuffle(_decompress(segments["positions"], changed * pdt.itemsize), pdt, changed)
    positions = np.cumsum(gaps, dtype=np.int64) + np.arange(1, changed + 1, dtype=np.int64) - 1
    if changed and positions[-1] >= numel:
        raise DecodeError(f"position {int(positions[-1])} beyond {numel} values")
    key = "xor" if encoding == "xor" else "values"
    values = unshuffle(_decompress(segments[key], changed * uint.itemsize), uint, changed)
    return positions, values


def apply_decoded(target: np.ndarray, d: DecodedTensor) -> None:
    """Write one decoded change into ``target`` (flat uint view) in place."""
    if d.encoding == "none":
        return
    assert d.values is not None, f"{d.name}: a {d.encoding} change without values"
    if d.encoding == "overwrite":
        if d.positions is None:
            np.copyto(target, d.values)
        else:
            target[d.positions] = d.values
    elif d.positions is None:
        np.bitwise_xor(target, d.values, out=target)
    else:
        target[d.positions] = target[d.positions] ^ d.values
