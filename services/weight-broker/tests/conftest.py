"""Shared fixtures: a tiny model, a trainer publishing to a weight store, and one CPU engine process."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from rlfleet.engine.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=1)


@pytest.fixture(scope="session")
def store_root(tmp_path_factory):
    return tmp_path_factory.mktemp("store")


@pytest.fixture(scope="session")
def engine(model_dir, store_root, tmp_path_factory):
    from rlfleet.engine.testing import EngineProcess

    process = EngineProcess(model_dir, tmp_path_factory.mktemp("engine"),
                            weight_store_root=store_root).start()
    yield process
    process.stop()
