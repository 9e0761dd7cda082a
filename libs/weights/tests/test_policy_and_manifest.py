"""When the store writes a full checkpoint, and what a manifest announces."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from rlfleet.weights import DirectoryWeightStore, WeightStore, WeightStoreConfig
from rlfleet.weights.index import INDEX_FILE, SCHEMA_VERSION


def test_the_directory_store_implements_the_weight_store_interface(make_store):
    assert isinstance(make_store(), WeightStore)


def test_a_full_checkpoint_is_written_every_k_versions_with_deltas_between(make_store, trainer):
    store = make_store(full_every=3)
    gen = trainer()
    kinds = [store.write_version(v, next(gen))["kind"] for v in range(7)]
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta", "full"]
    assert store.chain(5) == [3, 4, 5]
    assert store.list_versions() == list(range(7)) and store.latest_version() == 6


def test_a_changed_tensor_layout_forces_a_full_checkpoint(make_store):
    store = make_store()
    store.write_version(0, {"w": np.ones((2, 2), np.float32)})
    assert store.write_version(1, {"w": np.ones((2, 3), np.float32)})["kind"] == "full"
    assert (
        store.write_version(2, {"w": np.ones((2, 3), np.float32), "b": np.ones(2, np.float32)})["kind"]
        == "full"
    )


def test_a_delta_bigger_than_the_configured_share_of_a_full_checkpoint_is_written_full(make_store):
    rng = np.random.default_rng(0)
    store = make_store(max_delta_fraction=0.5)
    store.write_version(0, {"w": rng.standard_normal(4096).astype(np.float32)})
    assert store.write_version(1, {"w": rng.standard_normal(4096).astype(np.float32)})["kind"] == "full"


def test_the_manifest_names_everything_the_policy_announcement_needs(make_store, trainer):
    store = make_store(full_every=10)
    gen = trainer()
    full = store.write_version(0, next(gen))
    delta = store.write_version(1, next(gen))
    assert full["kind"] == "full" and full["base_version"] is None and full["full_version"] == 0
    assert delta["kind"] == "delta" and delta["base_version"] == 0 and delta["version"] == 1
    assert 0 < delta["bytes"] < full["bytes"]
    assert delta["uri"].startswith("file://") and store.version_from_uri(delta["uri"]) == 1
    raw = (store.path(1) / INDEX_FILE).read_bytes()
    assert delta["checksum"] == "sha256:" + hashlib.sha256(raw).hexdigest()
    assert delta == store.manifest(1)
    json.dumps(delta)  # goes on the wire as is


def test_the_delta_index_names_schema_version_base_encoding_checksum_and_every_tensor(make_store, trainer):
    store = make_store(encoding="overwrite", checksum="crc32", full_every=10)
    gen = trainer()
    store.write_version(0, next(gen))
    store.write_version(1, next(gen))
    index = json.loads((store.path(1) / INDEX_FILE).read_bytes())
    assert index["schema_version"] == SCHEMA_VERSION
    assert (index["version"], index["base_version"], index["kind"]) == (1, 0, "delta")
    assert (
        index["encoding"] == "overwrite" and index["checksum"] == "crc32" and index["compression"] == "zstd"
    )
    names = {t["name"] for t in index["tensors"]}
    assert names == set(next(trainer()))
    for t in index["tensors"]:
        assert {"name", "dtype", "shape", "encoding", "compressed_bytes", "checksum"} <= set(t)
        assert len(t["checksum"]) == 8  # crc32
    assert index["total_bytes"] == (store.path(1) / "delta.safetensors").stat().st_size


def test_a_restarted_trainer_writes_deltas_against_the_stored_parent(tmp_path, trainer, same_bytes):
    gen = trainer()
    first = DirectoryWeightStore(tmp_path, "r")
    first.write_version(0, next(gen))
    weights = next(gen)
    restarted = DirectoryWeightStore(tmp_path, "r")  # no in-memory copy of version 0
    assert restarted.write_version(1, weights)["kind"] == "delta"
    from rlfleet.weights import to_served

    same_bytes(restarted.load_version(1), to_served(weights))


def test_full_checkpoints_carry_the_base_models_config_and_tokenizer_files(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "qwen2", "torch_dtype": "float32"}))
    (base / "tokenizer.json").write_text("{}")
    (base / "model.safetensors").write_bytes(b"not copied")
    store = DirectoryWeightStore(tmp_path / "store", "r", base_dir=base)
    store.write_version(0, {"w": np.ones(3, np.float32)})
    files = sorted(p.name for p in store.path(0).iterdir())
    assert files == ["config.json", "model.safetensors", "rlfleet_index.json", "tokenizer.json"]
    assert json.loads((store.path(0) / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_unknown_config_keys_are_errors(tmp_path):
    with pytest.raises(ValueError):
        DirectoryWeightStore(tmp_path, "r", full_evry=3)
    with pytest.raises(ValueError):
        WeightStoreConfig(encoding="gzip")
