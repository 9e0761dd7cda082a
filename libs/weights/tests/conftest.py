"""Shared fixtures: the store implementations under contract test, and a fake
trainer whose fp32 master weights take Adam-like steps (sign of noise times a
learning rate), so only some bf16 values change per step, as in real training."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from rlfleet.weights import DirectoryWeightStore, WeightStore

SHAPES = {
    "model.embed_tokens.weight": (96, 32),
    "model.layers.0.self_attn.q_proj.weight": (32, 32),
    "model.layers.0.self_attn.q_proj.bias": (32,),
    "model.layers.0.mlp.up_proj.weight": (64, 32),
    "model.norm.weight": (32,),
}


@pytest.fixture(params=["directory"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[..., WeightStore]:
    """Every WeightStore implementation must pass the same tests; an object
    store adds its name to ``params`` and a branch here."""

    def make(run_id: str = "run1", **config: object) -> WeightStore:
        if request.param == "directory":
            return DirectoryWeightStore(tmp_path / "store", run_id, **config)
        raise AssertionError(request.param)

    return make


def fake_trainer(lr: float = 2e-5, seed: int = 0, shapes: dict = SHAPES) -> Iterator[dict[str, np.ndarray]]:
    """Yields successive fp32 state dicts; each step moves every weight by +-lr,
    which changes a fraction of the bf16 values that grows with lr."""
    rng = np.random.default_rng(seed)
    weights = {k: (rng.standard_normal(s) * 0.05).astype(np.float32) for k, s in shapes.items()}
    weights["model.norm.weight"] = np.ones(shapes["model.norm.weight"], dtype=np.float32)
    while True:
        yield {k: v.copy() for k, v in weights.items()}
        for v in weights.values():
            v += (lr * np.sign(rng.standard_normal(v.shape))).astype(np.float32)


@pytest.fixture
def trainer() -> Callable[..., Iterator[dict[str, np.ndarray]]]:
    return fake_trainer


def _assert_same_bytes(a, b) -> None:
    assert set(a) == set(b)
    for name in a:
        assert a.dtypes[name] == b.dtypes[name], name
        assert a[name].shape == b[name].shape, name
        assert a[name].tobytes() == b[name].tobytes(), name


@pytest.fixture
def same_bytes() -> Callable[..., None]:
    """Asserts two ServedTensors hold identical names, dtypes, shapes and bytes."""
    return _assert_same_bytes
