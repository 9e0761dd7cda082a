"""The sync policy alone: every N versions, the maximum lag, and what it skips."""

from rlfleet.broker.config import SyncConfig
from rlfleet.broker.policy import SyncPolicy


def policy(**config) -> SyncPolicy:
    return SyncPolicy(SyncConfig(**config))


def test_the_first_version_is_synced_at_once():
    decision = policy(every_n_versions=5).decide(None, {3: 0}, now_ms=0)
    assert decision.version == 3 and decision.skipped == ()


def test_with_every_version_each_new_version_is_synced_and_older_waiting_ones_are_skipped():
    decision = policy().decide(4, {5: 0, 6: 0}, now_ms=0)
    assert decision.version == 6 and decision.skipped == (5,)


def test_every_n_versions_waits_until_n_versions_have_passed():
    p = policy(every_n_versions=3)
    assert p.decide(10, {11: 0, 12: 0}, now_ms=0).version is None
    decision = p.decide(10, {11: 0, 12: 0, 13: 0}, now_ms=0)
    assert decision.version == 13 and decision.skipped == (11, 12)


def test_max_lag_syncs_the_newest_waiting_version_once_the_oldest_waited_long_enough():
    p = policy(every_n_versions=10, max_lag_s=2.0)
    assert p.decide(1, {2: 1_000, 3: 1_500}, now_ms=2_999).version is None
    assert p.next_deadline_ms(1, {2: 1_000, 3: 1_500}) == 3_000
    decision = p.decide(1, {2: 1_000, 3: 1_500}, now_ms=3_000)
    assert decision.version == 3 and decision.skipped == (2,) and "max_lag_s" in decision.reason


def test_versions_announced_after_a_newer_one_was_synced_are_skipped():
    decision = policy().decide(7, {5: 0}, now_ms=0)
    assert decision.version is None and decision.skipped == (5,)
