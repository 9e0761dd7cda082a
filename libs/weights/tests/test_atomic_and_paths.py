"""Versions appear whole or not at all, and nothing outside the store is read."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from rlfleet.weights import DirectoryWeightStore, PathOutsideStore, VersionExists, VersionNotFound, to_served

CRASHING_WRITER = textwrap.dedent("""
    import os, sys
    import numpy as np
    import rlfleet.weights.fsutil as fsutil
    import rlfleet.weights.writer as writer
    from rlfleet.weights import DirectoryWeightStore

    root, point = sys.argv[1], sys.argv[2]
    store = DirectoryWeightStore(root, "run1", full_every=100)
    w = {"w": np.linspace(-1, 1, 4096, dtype=np.float32)}
    store.write_version(0, w)

    def crash(*args, **kwargs):
        os._exit(17)  # a kill -9 at this point: no cleanup, no exception handlers

    if point == "payload":
        def half_written(path, tensors, metadata=None):
            with open(path, "wb") as f:
                f.write(b"\\0" * 1000)
            crash()
        writer.write_safetensors = half_written
    else:
        fsutil.publish_dir = crash
    store.write_version(1, {"w": w["w"] + np.float32(0.01)})
""")


@pytest.mark.parametrize("point", ["payload", "rename"])
def test_a_writer_killed_mid_write_leaves_no_visible_version(tmp_path, point):
    proc = subprocess.run([sys.executable, "-c", CRASHING_WRITER, str(tmp_path), point], timeout=60)
    assert proc.returncode == 17
    store = DirectoryWeightStore(tmp_path, "run1")
    assert store.list_versions() == [0] and store.latest_version() == 0
    with pytest.raises(VersionNotFound):
        store.load_version(1)
    leftovers = list(store.run_dir.glob(".tmp-*"))
    assert len(leftovers) == 1
    assert store.remove_stale_temp(older_than_s=0) == leftovers
    # The next writer proceeds as if nothing happened.
    store.write_version(1, {"w": np.zeros(4096, np.float32)})
    assert store.list_versions() == [0, 1]


def test_readers_running_during_writes_only_ever_see_complete_versions(tmp_path, trainer, same_bytes):
    writer = DirectoryWeightStore(tmp_path, "r", full_every=3)
    reader = DirectoryWeightStore(tmp_path, "r")
    gen = trainer(lr=1e-4)
    expected = {}
    errors: list[BaseException] = []
    done = threading.Event()

    def read_loop():
        while not done.is_set():
            latest = reader.latest_version()
            if latest is not None:
                try:
                    reader.load_version(latest)  # verifies every checksum
                except BaseException as e:  # surfaced below
                    errors.append(e)

    t = threading.Thread(target=read_loop)
    t.start()
    try:
        for v in range(8):
            weights = next(gen)
            writer.write_version(v, weights)
            expected[v] = to_served(weights)
    finally:
        done.set()
        t.join()
    assert not errors
    same_bytes(reader.load_version(7), expected[7])


def test_versions_are_write_once(make_store):
    store = make_store()
    store.write_version(0, {"w": np.ones(3, np.float32)})
    with pytest.raises(VersionExists):
        store.write_version(0, {"w": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match="not newer"):
        store.write_version(-1, {"w": np.zeros(3, np.float32)})


def test_a_uri_outside_the_store_is_refused(tmp_path):
    store = DirectoryWeightStore(tmp_path / "store", "run1")
    store.write_version(3, {"w": np.ones(3, np.float32)})
    other = DirectoryWeightStore(tmp_path / "store", "run2")
    other.write_version(3, {"w": np.ones(3, np.float32)})
    assert store.version_from_uri(store.uri(3)) == 3
    assert store.version_from_uri(str(store.path(3))) == 3
    assert store.version_from_uri("v000003") == 3
    for bad in [
        "/etc/passwd",
        "file:///etc",
        "../run2/v000003",
        str(other.path(3)),
        f"{store.run_dir}/../../../etc",
        "s3://bucket/run1/v000003",
    ]:
        with pytest.raises(PathOutsideStore):
            store.version_from_uri(bad)
    with pytest.raises(VersionNotFound):
        store.version_from_uri(str(store.run_dir / "not-a-version"))


def test_a_symlink_escaping_the_store_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    store = DirectoryWeightStore(tmp_path / "store", "run1")
    store.write_version(0, {"w": np.ones(3, np.float32)})
    (store.run_dir / "v000009").symlink_to(outside, target_is_directory=True)
    with pytest.raises(PathOutsideStore):
        store.version_from_uri(str(store.run_dir / "v000009"))
    model = store.path(0) / "model.safetensors"
    os.replace(model, outside / "model.safetensors")
    model.symlink_to(outside / "model.safetensors")
    with pytest.raises(PathOutsideStore):
        store.load_full(0)


@pytest.mark.parametrize("run_id", ["../escape", "a/b", "", ".hidden"])
def test_a_run_id_that_is_not_a_plain_name_is_refused(tmp_path, run_id):
    with pytest.raises(PathOutsideStore):
        DirectoryWeightStore(tmp_path, run_id)
