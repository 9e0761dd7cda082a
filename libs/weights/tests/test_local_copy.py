"""Node-local full copies: a delta applied to the held copy gives exactly the version the store
rebuilds, written as a plain HF directory (model.safetensors), and unheld directories go."""

from __future__ import annotations

import pytest

from rlfleet.weights import BaseVersionMismatch, CorruptDelta, DirectoryWeightStore, to_served
from rlfleet.weights.index import MODEL_FILE
from rlfleet.weights.local_copy import LocalCopies
from rlfleet.weights.safetensors_io import SafetensorsFile


def read_dir(path) -> dict[str, bytes]:
    with SafetensorsFile(path / MODEL_FILE) as f:
        return {name: f.read(name).tobytes() for name in f.entries}


def test_deltas_on_the_local_copy_give_the_trainers_bytes_in_a_loadable_directory(tmp_path,
                                                                                  trainer, same_bytes):
    store = DirectoryWeightStore(tmp_path / "store", "run1", full_every=100)
    weights = trainer()
    served = {}
    for version in range(4):
        state = next(weights)
        store.write_version(version, state)
        served[version] = to_served(state)
    copies = LocalCopies(store, tmp_path / "local")
    first = copies.stage_full(0)
    copies.commit(first, holder="e0")
    assert first.kind == "full" and copies.held("e0") == 0
    for version in (1, 2, 3):
        staged = copies.stage_delta(version, holder="e0")
        assert staged.kind == "delta" and 0 < staged.changed_fraction < 1 and staged.payload_bytes > 0
        same_bytes(staged.tensors, served[version])
        on_disk = read_dir(staged.path)
        assert on_disk == {name: served[version][name].tobytes() for name in served[version]}
        copies.commit(staged, holder="e0")
        # The previous version's directory is gone: no engine holds it.
        assert sorted(p.name for p in copies.root.glob("v*")) == [f"v{version:06d}"]


def test_a_delta_that_is_not_on_the_held_copy_or_corrupt_changes_nothing(tmp_path, trainer):
    store = DirectoryWeightStore(tmp_path / "store", "run1", full_every=100)
    weights = trainer()
    for version in range(3):
        store.write_version(version, next(weights))
    copies = LocalCopies(store, tmp_path / "local")
    with pytest.raises(BaseVersionMismatch):
        copies.stage_delta(1, holder="new-engine")  # holds no copy: needs a full load first
    copies.commit(copies.stage_full(0), holder="e0")
    with pytest.raises(BaseVersionMismatch):
        copies.stage_delta(2, holder="e0")  # delta 2 is on version 1
    delta = store.path(1) / "delta.safetensors"
    raw = bytearray(delta.read_bytes())
    raw[-20] ^= 0xFF
    delta.write_bytes(bytes(raw))
    with pytest.raises(CorruptDelta):
        copies.stage_delta(1, holder="e0")
    assert copies.held("e0") == 0 and [p.name for p in copies.root.glob("v*")] == ["v000000"]
