"""Fixtures shared by the integration tests that put a weight store under two CPU engine processes
(the broker's and the trainer's tests). A module that asks for `engines` defines its own `model_dir`:
the tests differ in which tiny model the engines serve."""

from __future__ import annotations

import threading

import pytest

from rlfleet.engine.testing import EngineProcess


@pytest.fixture(scope="module")
def store_root(tmp_path_factory):
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def engines(model_dir, store_root, tmp_path_factory):
    """c0 (canary) and f0 (fleet), started side by side, loading weights from under `store_root`."""
    workdir = tmp_path_factory.mktemp("engines")
    procs = {name: EngineProcess(model_dir, workdir / name, weight_store_root=store_root, engine_id=name)
             for name in ("c0", "f0")}  # fmt: skip
    threads = [threading.Thread(target=p.start) for p in procs.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert all(p.url for p in procs.values()), "an engine did not start"
        yield procs
    finally:
        for p in procs.values():
            p.stop()
