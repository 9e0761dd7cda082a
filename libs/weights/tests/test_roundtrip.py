from __future__ import annotations

import numpy as np
import pytest

from rlfleet.weights import DirectoryWeightStore, apply_delta, preverify_delta, to_served
from rlfleet.weights.tensors import bf16_bits_to_fp32, fp32_to_bf16_bits


@pytest.mark.parametrize("encoding", ["xor", "overwrite", "auto"])
def test_weights_rebuilt_after_five_deltas_are_bit_identical_to_the_trainers(
    make_store, encoding, trainer, same_bytes
):
    store = make_store(encoding=encoding, full_every=100)
    trainer = trainer()
    history = {}
    for version in range(6):
        weights = next(trainer)
        manifest = store.write_version(version, weights)
        history[version] = to_served(weights)
        assert manifest["kind"] == ("full" if version == 0 else "delta")
    index = store.index(5)
    assert {e.encoding for e in index.tensors} <= {encoding, "none"} or encoding == "auto"
    for version, expected in history.items():
        same_bytes(store.load_version(version), expected)


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_incremental_apply_equals_load_version(make_store, encoding, trainer, same_bytes):
    store = make_store(encoding=encoding, full_every=100)
    trainer = trainer(lr=4e-5)
    for version in range(5):
        store.write_version(version, next(trainer))
    engine = store.load_full(0)
    for version in range(1, 5):
        decoded = store.fetch_delta(version)
        result = apply_delta(engine, decoded, current_version=version - 1)
        assert result.version == version and result.verified == "written"
        same_bytes(engine, store.load_version(version))


def test_preverified_delta_swaps_without_hashing_and_gives_the_same_bytes(make_store, trainer, same_bytes):
    store = make_store(full_every=100)
    trainer = trainer()
    store.write_version(0, next(trainer))
    store.write_version(1, next(trainer))
    engine = store.load_full(0)
    decoded = store.fetch_delta(1)
    preverify_delta(engine, decoded)
    assert apply_delta(engine, decoded, current_version=0).verified == "preverified"
    same_bytes(engine, store.load_version(1))


def test_served_bf16_is_what_is_compared_not_the_fp32_master_weights(make_store):
    store = make_store(full_every=100)
    base = np.full((4, 8), 1.0, dtype=np.float32)
    store.write_version(0, {"w": base})
    # A step far below bf16's resolution at 1.0 (2**-7): fp32 changes, bf16 does not.
    tiny = base + np.float32(1e-5)
    manifest = store.write_version(1, {"w": tiny})
    assert manifest["kind"] == "delta" and manifest["changed_values"] == 0
    loaded = store.load_version(1)
    assert loaded.dtypes["w"] == "BF16"
    assert np.array_equal(loaded.to_float32("w"), base)
    # The checksum is over the served bf16 bytes, so it equals version 0's.
    assert store.index(1).tensors[0].checksum == store.index(0).tensors[0].checksum
    # Accumulated steps do cross a bf16 boundary and are then served.
    many = base + np.float32(0.01)
    store.write_version(2, {"w": many})
    assert np.array_equal(store.load_version(2)["w"], fp32_to_bf16_bits(many))


def test_numpy_bf16_rounding_matches_torch_bit_for_bit():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    x = np.concatenate(
        [
            rng.standard_normal(10_000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 10_000),
            np.array(
                [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 3.4e38, -3.4e38, 1e-45, 1.00390625], np.float32
            ),
        ]
    ).astype(np.float32)
    ours = fp32_to_bf16_bits(x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, theirs)
    assert np.array_equal(
        bf16_bits_to_fp32(ours)[:100], torch.from_numpy(x[:100]).to(torch.bfloat16).float().numpy()
    )


def test_fp32_served_store_keeps_the_trainers_exact_fp32_values(make_store, trainer):
    store = make_store(served_dtype="fp32", full_every=100)
    trainer = trainer(lr=4e-5)
    weights = [next(trainer) for _ in range(3)]
    for version, w in enumerate(weights):
        store.write_version(version, w)
    loaded = store.load_version(2)
    for name, arr in weights[2].items():
        assert loaded.dtypes[name] == "F32" and np.array_equal(loaded[name], arr)


def test_integer_tensors_keep_their_dtype(make_store):
    store = make_store()
    store.write_version(0, {"w": np.ones(4, np.float32), "pos": np.arange(6, dtype=np.int64)})
    loaded = store.load_full(0)
    assert loaded.dtypes == {"w": "BF16", "pos": "I64"}
    assert np.array_equal(loaded["pos"], np.arange(6))


def test_full_checkpoint_loads_with_the_reference_safetensors_reader(tmp_path, trainer):
    st = pytest.importorskip("safetensors.torch")
    torch = pytest.importorskip("torch")
    store = DirectoryWeightStore(tmp_path, "r")
    weights = next(trainer())
    store.write_version(0, weights)
    loaded = st.load_file(store.path(0) / "model.safetensors")
    for name, arr in weights.items():
        assert loaded[name].dtype == torch.bfloat16
        assert torch.equal(loaded[name], torch.from_numpy(arr).to(torch.bfloat16))


def test_a_full_reload_reads_straight_into_the_engines_own_buffers(make_store, trainer, same_bytes):
    store = make_store()
    gen = trainer()
    store.write_version(0, next(gen))
    engine = {k: np.zeros_like(v) for k, v in store.load_full(0).items()}
    buffers = {k: v.ctypes.data for k, v in engine.items()}
    loaded = store.load_full(0, into=engine)
    assert {k: v.ctypes.data for k, v in loaded.items()} == buffers
    same_bytes(loaded, store.load_full(0))
