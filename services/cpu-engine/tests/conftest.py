"""Shared fixtures: two tiny models built once per session (same tokenizer, different weights),
an in-process model runner, and an engine process shared by the read-mostly HTTP tests."""

from __future__ import annotations

import pytest
import torch

from rlfleet.engine.testing import EngineProcess, build_tiny_model


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    # Two cores shared with other agents: tests pin torch to one thread.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "v1", seed=1)


@pytest.fixture(scope="session")
def model_dir_v2(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "v2", seed=2)


@pytest.fixture(scope="session")
def runner(model_dir):
    from rlfleet.engine.model_runner import ModelRunner

    return ModelRunner(model_dir)


@pytest.fixture(scope="session")
def engine(model_dir, tmp_path_factory):
    process = EngineProcess(model_dir, tmp_path_factory.mktemp("engine")).start()
    yield process
    process.stop()
