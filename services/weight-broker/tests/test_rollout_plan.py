"""How an engine gets from the version it serves to its target: deltas in turn, or one full load."""

from __future__ import annotations

import numpy as np
import pytest

from rlfleet.broker.config import SyncConfig
from rlfleet.broker.metrics import BrokerMetrics
from rlfleet.broker.pools import Pools
from rlfleet.broker.rollout import Rollout
from rlfleet.common.engine_client import EngineTimeouts
from rlfleet.weights import DirectoryWeightStore


@pytest.fixture
def store(tmp_path):
    """Versions 1 (full), 2..4 (deltas), 5 (full), 6 (delta)."""
    store = DirectoryWeightStore(tmp_path, "plan", full_every=4)
    rng = np.random.default_rng(0)
    weights = {"w": rng.standard_normal((32, 32)).astype(np.float32)}
    for version in range(1, 7):
        weights["w"][version % 32] += 0.25
        store.write_version(version, weights)
    assert [store.index(v).kind for v in range(1, 7)] == ["full", "delta", "delta", "delta", "full", "delta"]
    return store


def rollout(store, **sync) -> Rollout:
    return Rollout(store, Pools([], None, EngineTimeouts()), None, BrokerMetrics(), SyncConfig(**sync))


def test_an_engine_one_version_behind_gets_one_delta(store):
    assert rollout(store).plan(3, 4) == [4]


def test_an_engine_a_few_versions_behind_gets_each_delta_in_turn(store):
    assert rollout(store).plan(1, 4) == [2, 3, 4]


def test_further_behind_than_max_delta_chain_it_gets_one_full_load(store):
    assert rollout(store, max_delta_chain=2).plan(1, 4) == []


def test_a_full_checkpoint_in_between_an_unknown_version_or_a_rollback_mean_a_full_load(store):
    r = rollout(store)
    assert r.plan(4, 6) == []  # v5 is a full checkpoint
    assert r.plan(None, 3) == []  # the engine serves no version of this run
    assert r.plan(4, 2) == []  # going back
    assert r.plan(5, 6) == [6]


def test_the_disk_full_transport_never_plans_deltas(store):
    assert rollout(store, transport="disk_full").plan(3, 4) == []
