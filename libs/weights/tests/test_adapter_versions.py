"""LoRA adapter versions: a base version + peft's directory, checksummed, listed, fetched, merged."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlfleet.weights import BadAdapter, CorruptAdapter, DirectoryWeightStore, VersionNotFound, to_served
from rlfleet.weights.adapter import ADAPTER_CONFIG_FILE, ADAPTER_FILE
from rlfleet.weights.index import INDEX_FILE

RANK, ALPHA = 4, 8.0
CONFIG = {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": ["q_proj"], "bias": "none",
          "task_type": "CAUSAL_LM", "use_dora": False, "use_rslora": False}


def base_weights(rng) -> dict[str, np.ndarray]:
    return {"model.layers.0.self_attn.q_proj.weight": rng.standard_normal((16, 12)).astype(np.float32),
            "model.layers.0.mlp.up_proj.weight": rng.standard_normal((8, 12)).astype(np.float32),
            "model.norm.weight": np.ones(12, dtype=np.float32)}


def adapter_weights(rng, scale: float = 0.1) -> dict[str, np.ndarray]:
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    return {f"{prefix}.lora_A.weight": (scale * rng.standard_normal((RANK, 12))).astype(np.float32),
            f"{prefix}.lora_B.weight": (scale * rng.standard_normal((16, RANK))).astype(np.float32)}


@pytest.fixture
def store(tmp_path):
    s = DirectoryWeightStore(tmp_path / "weights", "run")
    s.write_version(0, base_weights(np.random.default_rng(0)))
    return s


def test_an_adapter_version_round_trips_with_its_config_and_names_its_base(store):
    rng = np.random.default_rng(1)
    first, second = adapter_weights(rng), adapter_weights(rng)
    m1 = store.write_adapter(1, first, CONFIG, base_version=0)
    m2 = store.write_adapter(2, second, CONFIG, base_version=0, parent_version=1)
    assert (m1["kind"], m1["base_version"], m1["full_version"]) == ("adapter", 0, 0)
    assert m2["bytes"] < store.manifest(0)["bytes"]
    assert store.list_versions() == [0, 1, 2]
    tensors, config = store.load_adapter(2)
    assert config == CONFIG
    want = to_served(second)
    assert all(np.array_equal(tensors[k], want[k]) for k in want)
    # The directory is peft's: adapter_config.json + adapter_model.safetensors, nothing to convert.
    path = store.fetch_adapter(1)
    assert {p.name for p in path.iterdir()} == {ADAPTER_CONFIG_FILE, ADAPTER_FILE, INDEX_FILE}
    assert json.loads((path / ADAPTER_CONFIG_FILE).read_text()) == CONFIG


def test_the_merged_version_is_the_base_plus_the_scaled_low_rank_update(store):
    adapter = adapter_weights(np.random.default_rng(2))
    store.write_adapter(1, adapter, CONFIG, base_version=0)
    merged = store.load_version(1)  # what an engine without LoRA, or any consumer, gets
    base = store.load_version(0)
    name = "model.layers.0.self_attn.q_proj.weight"
    a, b = (to_served(adapter).to_float32(k) for k in sorted(adapter))  # lora_A, lora_B
    expected = base.to_float32(name) + ALPHA / RANK * (b @ a)
    np.testing.assert_allclose(merged.to_float32(name), expected, rtol=1e-2, atol=1e-2)  # bf16 rounding
    assert not np.array_equal(merged[name], base[name])
    for other in ("model.layers.0.mlp.up_proj.weight", "model.norm.weight"):
        assert np.array_equal(merged[other], base[other])
    # ...and as an HF directory on request, checksummed like a full version.
    path = store.write_merged(1)
    assert ((path / "model.safetensors").is_file()
            and json.loads((path / INDEX_FILE).read_text())["kind"] == "full")
    assert store.list_versions() == [0, 1]  # a merged copy is not a new version


def test_a_flipped_adapter_byte_or_an_edited_config_is_caught_by_the_checksums(store):
    store.write_adapter(1, adapter_weights(np.random.default_rng(3)), CONFIG, base_version=0)
    payload = store.path(1) / ADAPTER_FILE
    data = bytearray(payload.read_bytes())
    data[-7] ^= 0x5A
    payload.write_bytes(bytes(data))
    with pytest.raises(CorruptAdapter, match="expected"):
        store.fetch_adapter(1)
    with pytest.raises(CorruptAdapter):
        store.load_version(1)

    store.write_adapter(2, adapter_weights(np.random.default_rng(4)), CONFIG, base_version=0)
    (store.path(2) / ADAPTER_CONFIG_FILE).write_text(json.dumps({**CONFIG, "lora_alpha": 80.0}))
    with pytest.raises(CorruptAdapter, match="adapter_config.json"):
        store.load_adapter(2)
    (store.path(2) / ADAPTER_FILE).unlink()
    with pytest.raises(CorruptAdapter, match="missing"):
        store.load_adapter(2)


def test_an_adapter_that_does_not_fit_its_base_is_refused_before_anything_is_written(store):
    rng = np.random.default_rng(5)
    wrong_rank = adapter_weights(rng)
    with pytest.raises(BadAdapter, match="rank"):
        store.write_adapter(1, wrong_rank, {**CONFIG, "r": 2}, base_version=0)
    with pytest.raises(BadAdapter, match="no 'model.layers.0.self_attn.k_proj.weight'"):
        store.write_adapter(1, {k.replace("q_proj", "k_proj"): v for k, v in wrong_rank.items()}, CONFIG, 0)
    with pytest.raises(BadAdapter, match="DoRA"):
        store.write_adapter(1, wrong_rank, {**CONFIG, "use_dora": True}, base_version=0)
    with pytest.raises(BadAdapter, match="not a LoRA factor"):
        store.write_adapter(1, {**wrong_rank,
                                "base_model.model.lm_head.lora_embedding_A": np.zeros(3)}, CONFIG, 0)
    store.write_adapter(1, wrong_rank, CONFIG, base_version=0)
    with pytest.raises(BadAdapter, match="not a full version"):
        store.write_adapter(2, wrong_rank, CONFIG, base_version=1)
    with pytest.raises(VersionNotFound):
        store.write_adapter(2, wrong_rank, CONFIG, base_version=7)
    assert store.list_versions() == [0, 1]


def test_a_full_version_after_adapters_is_written_whole(store):
    store.write_adapter(1, adapter_weights(np.random.default_rng(6)), CONFIG, base_version=0)
    manifest = store.write_version(2, base_weights(np.random.default_rng(7)))
    assert manifest["kind"] == "full"
    with pytest.raises(VersionNotFound, match="it is a full"):
        store.load_adapter(2)


def trained(adapter: dict[str, np.ndarray], rng, step: float = 1e-3) -> dict[str, np.ndarray]:
    """The adapter after an optimizer step: every value moves a little (as Adam moves it)."""
    return {k: (v + step * np.sign(rng.standard_normal(v.shape)) * np.abs(v)).astype(np.float32)
            for k, v in adapter.items()}


def test_a_trained_adapter_is_stored_as_a_delta_of_its_parent_and_fetched_as_a_whole_peft_directory(store):
    rng = np.random.default_rng(8)
    versions = [adapter_weights(rng)]
    for _ in range(3):
        versions.append(trained(versions[-1], rng))
    store.write_adapter(1, versions[0], CONFIG, base_version=0, parent_version=0)  # the base: whole
    for v in (2, 3, 4):
        store.write_adapter(v, versions[v - 1], CONFIG, base_version=0, parent_version=v - 1)
    whole = DirectoryWeightStore(store.root, "whole")  # the same adapters, each written whole
    whole.write_version(0, base_weights(np.random.default_rng(0)))
    whole.write_adapter(4, versions[3], CONFIG, base_version=0)
    assert store.index(1).adapter_parent is None
    assert [store.index(v).adapter_parent for v in (2, 3, 4)] == [1, 2, 3]
    assert store.manifest(4)["bytes"] < whole.manifest(4)["bytes"]  # tiny tensors: headers are most of both
    assert {p.name for p in store.path(4).iterdir()} == {ADAPTER_CONFIG_FILE, "delta.safetensors", INDEX_FILE}
    tensors, config = store.load_adapter(4)
    assert config == CONFIG
    want = to_served(versions[3])
    assert all(np.array_equal(tensors[k], want[k]) for k in want)
    # Loaders get peft's directory, the same tensor bytes as the adapter written whole.
    path = store.fetch_adapter(4)
    assert (path == store.adapter_path(4)
            and {p.name for p in path.iterdir()} == {ADAPTER_CONFIG_FILE, ADAPTER_FILE})
    from rlfleet.weights.safetensors_io import SafetensorsFile

    with SafetensorsFile(path / ADAPTER_FILE) as got, SafetensorsFile(whole.path(4) / ADAPTER_FILE) as ref:
        assert all(got.read(k).tobytes() == ref.read(k).tobytes() for k in want)
    assert json.loads((path / ADAPTER_CONFIG_FILE).read_text()) == CONFIG
    assert np.array_equal(store.load_version(4)["model.layers.0.self_attn.q_proj.weight"],
                          whole.load_version(4)["model.layers.0.self_attn.q_proj.weight"])
    # A restarted writer (no memory of the last adapter) still writes a delta, from the store's copy.
    again = DirectoryWeightStore(store.root, "run")
    again.write_adapter(5, trained(versions[3], rng), CONFIG, base_version=0, parent_version=4)
    assert again.index(5).adapter_parent == 4


def test_a_damaged_adapter_delta_or_rebuilt_directory_is_caught_and_a_changed_config_is_written_whole(store):
    rng = np.random.default_rng(9)
    first = adapter_weights(rng)
    store.write_adapter(1, first, CONFIG, base_version=0)
    store.write_adapter(2, trained(first, rng), CONFIG, base_version=0, parent_version=1)
    rebuilt = store.fetch_adapter(2) / ADAPTER_FILE
    data = bytearray(rebuilt.read_bytes())
    data[-3] ^= 0x21
    rebuilt.write_bytes(bytes(data))
    with pytest.raises(CorruptAdapter, match="expected"):
        store.fetch_adapter(2)  # the rebuilt copy is checked on every fetch, not trusted once written
    payload = store.path(1) / ADAPTER_FILE  # the parent a delta is applied to
    data = bytearray(payload.read_bytes())
    data[-5] ^= 0x5A
    payload.write_bytes(bytes(data))
    with pytest.raises(CorruptAdapter):
        store.load_adapter(2)
    store.write_adapter(3, first, {**CONFIG, "lora_alpha": 16.0}, base_version=0, parent_version=2)
    assert store.index(3).adapter_parent is None  # another scaling: not a delta of the old one
    few = DirectoryWeightStore(store.root, "few", full_every=2)
    few.write_version(0, base_weights(np.random.default_rng(0)))
    adapters = [first]
    for _ in range(3):
        adapters.append(trained(adapters[-1], rng))
    for v, a in enumerate(adapters, start=1):
        few.write_adapter(v, a, CONFIG, base_version=0, parent_version=v - 1)
    assert [few.index(v).adapter_parent for v in (1, 2, 3, 4)] == [None, 1, None, 3]  # full_every counts
