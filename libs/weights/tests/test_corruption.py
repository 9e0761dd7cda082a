"""A damaged or misapplied update is refused with a typed error, and recover()
always hands back weights that are exactly some version the trainer wrote."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlfleet.weights import (
    BaseVersionMismatch,
    CorruptCheckpoint,
    CorruptDelta,
    CorruptVersion,
    VersionNotFound,
    apply_delta,
    preverify_delta,
    to_served,
)
from rlfleet.weights.index import DELTA_FILE, INDEX_FILE, MODEL_FILE


def publish(store, trainer, n: int = 4, **kw):
    gen = trainer(**kw)
    served = {}
    for version in range(n):
        weights = next(gen)
        store.write_version(version, weights)
        served[version] = to_served(weights)
    return served


def flip_byte(path, offset_from_end: int = 40) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - offset_from_end] ^= 0x5A
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
def test_a_flipped_byte_in_a_delta_raises_corrupt_delta_before_the_engine_pauses(
    make_store, trainer, same_bytes, encoding
):
    store = make_store(encoding=encoding, full_every=100)
    served = publish(store, trainer)
    flip_byte(store.path(3) / DELTA_FILE)
    with pytest.raises(CorruptDelta) as info:
        store.fetch_delta(3)
    assert info.value.version == 3
    # Version 3 cannot be rebuilt; recover gives the newest exact one, labelled as such.
    recovered = store.recover(3)
    assert recovered.version == 2 and recovered.requested == 3
    assert isinstance(recovered.errors[0], CorruptDelta)
    same_bytes(recovered.tensors, served[2])
    with pytest.raises(CorruptDelta):
        store.recover(3, allow_older=False)


def test_engine_memory_that_is_not_the_base_fails_the_checksum_and_recover_gives_exact_weights(
    make_store, trainer, same_bytes
):
    store = make_store(full_every=100)
    served = publish(store, trainer)
    engine = store.load_version(2)
    engine["model.layers.0.mlp.up_proj.weight"][3, 3] ^= 0x0100  # a bit flip in the engine's copy
    decoded = store.fetch_delta(3)
    with pytest.raises(CorruptDelta) as info:
        apply_delta(engine, decoded, current_version=2)
    assert info.value.tensor == "model.layers.0.mlp.up_proj.weight"
    recovered = store.recover(3)
    assert recovered.version == 3 and not recovered.errors
    same_bytes(recovered.tensors, served[3])


def test_preverify_catches_a_wrong_base_without_modifying_the_engine(make_store, trainer):
    store = make_store(full_every=100)
    publish(store, trainer)
    engine = store.load_version(2)
    engine["model.layers.0.mlp.up_proj.weight"][0, 0] ^= 1
    before = {k: v.copy() for k, v in engine.items()}
    with pytest.raises(CorruptDelta):
        preverify_delta(engine, store.fetch_delta(3))
    assert all(np.array_equal(before[k], engine[k]) for k in engine)


def test_missing_delta_file_raises_and_recover_falls_back_to_the_newest_exact_version(
    make_store, trainer, same_bytes
):
    store = make_store(full_every=100)
    served = publish(store, trainer, n=5)
    (store.path(2) / DELTA_FILE).unlink()
    with pytest.raises(CorruptDelta, match="missing"):
        store.fetch_delta(2)
    with pytest.raises(CorruptDelta):
        store.load_version(4)  # the chain to 4 goes through 2
    recovered = store.recover(4)
    assert recovered.version == 1
    same_bytes(recovered.tensors, served[1])


def test_a_missing_version_directory_is_version_not_found(make_store, trainer):
    store = make_store()
    publish(store, trainer, n=2)
    with pytest.raises(VersionNotFound):
        store.fetch_delta(7)
    with pytest.raises(VersionNotFound):
        store.manifest(7)


def test_a_later_full_checkpoint_makes_versions_after_a_broken_delta_exact_again(
    make_store, trainer, same_bytes
):
    store = make_store(full_every=3)  # 0 full, 1-2 delta, 3 full, 4 delta
    served = publish(store, trainer, n=5)
    (store.path(2) / DELTA_FILE).unlink()
    recovered = store.recover(4)
    assert recovered.version == 4
    same_bytes(recovered.tensors, served[4])


def test_a_truncated_delta_raises_corrupt_delta(make_store, trainer):
    store = make_store(full_every=100)
    publish(store, trainer, n=2)
    path = store.path(1) / DELTA_FILE
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CorruptDelta, match=r"truncated|short|offsets"):
        store.fetch_delta(1)


def test_an_edited_index_is_caught_by_the_final_checksum(make_store, trainer):
    store = make_store(encoding="overwrite", full_every=100)
    publish(store, trainer, n=2)
    path = store.path(1) / INDEX_FILE
    index = json.loads(path.read_bytes())
    entry = next(t for t in index["tensors"] if t["encoding"] == "overwrite")
    entry["position_dtype"] = {"uint8": "uint16", "uint16": "uint8"}[entry["position_dtype"]]
    path.write_text(json.dumps(index))
    with pytest.raises(CorruptVersion):
        store.load_version(1)


def test_an_unparseable_index_is_corrupt_not_missing(make_store, trainer):
    store = make_store()
    publish(store, trainer, n=2)
    (store.path(1) / INDEX_FILE).write_text("{not json")
    with pytest.raises(CorruptVersion):
        store.fetch_delta(1)


def test_a_flipped_byte_in_a_full_checkpoint_raises_corrupt_checkpoint(make_store, trainer):
    store = make_store()
    publish(store, trainer, n=1)
    flip_byte(store.path(0) / MODEL_FILE, offset_from_end=7)
    with pytest.raises(CorruptCheckpoint):
        store.load_full(0)
    with pytest.raises(CorruptCheckpoint):
        store.recover(0)


def test_a_delta_for_another_base_version_is_refused(make_store, trainer):
    store = make_store(full_every=100)
    publish(store, trainer)
    engine = store.load_version(1)
    with pytest.raises(BaseVersionMismatch) as info:
        apply_delta(engine, store.fetch_delta(3), current_version=1)
    assert (info.value.expected, info.value.actual) == (2, 1)


def test_an_xor_delta_is_applied_exactly_once(make_store, trainer):
    store = make_store(encoding="xor", full_every=100)
    publish(store, trainer, n=2)
    engine = store.load_version(0)
    decoded = store.fetch_delta(1)
    apply_delta(engine, decoded)
    with pytest.raises(BaseVersionMismatch, match="already applied"):
        apply_delta(engine, decoded)


def test_an_overwrite_delta_is_idempotent(make_store, trainer, same_bytes):
    store = make_store(encoding="overwrite", full_every=100)
    served = publish(store, trainer, n=2)
    engine = store.load_version(0)
    decoded = store.fetch_delta(1)
    apply_delta(engine, decoded)
    apply_delta(engine, decoded)
    same_bytes(engine, served[1])


def test_tensors_of_the_wrong_shape_are_a_base_mismatch(make_store, trainer):
    store = make_store(full_every=100)
    publish(store, trainer, n=2)
    engine = dict(store.load_version(0))
    engine["model.layers.0.mlp.up_proj.weight"] = np.zeros(5, np.uint16)
    with pytest.raises(BaseVersionMismatch, match="up_proj"):
        apply_delta(engine, store.fetch_delta(1))
