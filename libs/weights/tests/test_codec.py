"""The per-tensor codec on its own: encodings, positions, compression."""

from __future__ import annotations

import numpy as np
import pytest

from rlfleet.weights.codec import (
    XOR_BOTH_BELOW,
    XOR_DENSE_FROM,
    DecodedTensor,
    apply_decoded,
    candidates,
    decode_segments,
    encode_tensor,
    shuffle,
    unshuffle,
)


def changed_copy(n: int, density: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 2**16, n, dtype=np.uint16)
    new = old.copy()
    idx = rng.choice(n, int(n * density), replace=False)
    new[idx] ^= rng.integers(1, 2**7, idx.size, dtype=np.uint16)  # mantissa-bit changes, like real steps
    return old, new


def roundtrip(old, new, encoding):
    enc = encode_tensor(old, new, encoding)
    positions, values = decode_segments(
        encoding=enc.encoding,
        changed=enc.changed,
        numel=enc.numel,
        uint=old.dtype,
        segments=enc.segments,
        position_dtype=enc.position_dtype,
    )
    target = old.copy()
    apply_decoded(
        target, DecodedTensor("t", "BF16", old.shape, enc.encoding, enc.changed, "", positions, values)
    )
    return enc, target


@pytest.mark.parametrize("encoding", ["xor", "overwrite", "auto"])
@pytest.mark.parametrize("density", [0.0, 1e-4, 0.03, 0.3, 0.8, 1.0])
def test_every_encoding_reproduces_the_new_bytes_at_any_change_density(encoding, density):
    old, new = changed_copy(50_000, density)
    enc, target = roundtrip(old, new, encoding)
    assert np.array_equal(target, new)
    assert enc.changed == int(np.count_nonzero(old != new))
    if density == 0:
        assert enc.encoding == "none" and not enc.segments


def test_positions_use_the_narrowest_gap_width_that_fits():
    old = np.zeros(200_000, np.uint16)
    dense = old.copy()
    dense[::7] = 1
    sparse = old.copy()
    sparse[[5, 150_000]] = 1
    assert encode_tensor(old, dense, "overwrite").position_dtype == "uint8"
    assert encode_tensor(old, sparse, "overwrite").position_dtype == "uint32"
    _, target = roundtrip(old, sparse, "overwrite")
    assert np.array_equal(target, sparse)


def test_auto_keeps_the_smaller_encoding():
    for density in (1e-3, 0.5):
        old, new = changed_copy(100_000, density)
        sizes = {e: encode_tensor(old, new, e).compressed_bytes for e in ("xor", "overwrite")}
        smallest = min(c.compressed_bytes for c in candidates(old, new, "auto"))  # both xor layouts too
        assert encode_tensor(old, new, "auto").compressed_bytes == smallest <= min(sizes.values())


def test_xor_compresses_one_layout_chosen_by_the_share_of_values_changed():
    """Each tensor is compressed once: sparse below XOR_DENSE_FROM changed, dense from it; the choice
    is the smaller of the two on both sides of the line (what auto, which compresses both, keeps).
    A small tensor gets both layouts, the smaller kept."""
    for density, layout in ((0.02, "sparse"), (0.3, "sparse"), (XOR_DENSE_FROM, "dense"), (0.9, "dense")):
        old, new = changed_copy(100_000, density)
        (chosen,) = candidates(old, new, "xor")
        assert chosen.layout == layout, density
        both = {c.layout: c.compressed_bytes for c in candidates(old, new, "auto") if c.encoding == "xor"}
        assert chosen.compressed_bytes == both[layout]
        if density != XOR_DENSE_FROM:  # at the line itself the two are within a few percent
            assert chosen.compressed_bytes == min(both.values()), (density, both)
        _, target = roundtrip(old, new, "xor")
        assert np.array_equal(target, new)
    old, new = changed_copy(XOR_BOTH_BELOW - 1, 0.3)
    assert {c.layout for c in candidates(old, new, "xor")} == {"dense", "sparse"}


def test_byte_shuffle_roundtrips_every_width():
    for dt in (np.uint8, np.uint16, np.uint32, np.uint64):
        a = np.random.default_rng(0).integers(0, np.iinfo(dt).max, 1000, dtype=dt)
        assert np.array_equal(unshuffle(shuffle(a).tobytes(), np.dtype(dt), a.size), a)
