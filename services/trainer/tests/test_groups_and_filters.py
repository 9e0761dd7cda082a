import pytest

from rlfleet.trainer.batching import TrainSample
from rlfleet.trainer.filters import GroupFilters
from rlfleet.trainer.groups import GroupBuffer
from rlfleet.trainer.service_config import GroupFilterConfig
from rlfleet.trainer.validation import Candidate, Rejected


def cand(group: str, k: int, reward: float = 0.0, version: int | None = 0, group_size: int = 0) -> Candidate:
    sample = TrainSample(f"{group}-{k}", group, [1, 2, 3], [0.0, -1.0, -1.0], [0, 1, 1], reward,
                         version if version is not None else 0)
    return Candidate(sample, group_size=group_size, sample_index=k, oldest_version=version)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_group_completes_when_g_samples_arrived_and_lists_them_by_sample_index():
    buf = GroupBuffer(default_size=3, timeout_s=10)
    assert buf.add(cand("g", 2)) is None and buf.add(cand("g", 0)) is None
    group = buf.add(cand("g", 1))
    assert group is not None and [c.sample_index for c in group.samples()] == [0, 1, 2]
    assert len(buf) == 0


def test_the_samples_held_are_those_of_the_groups_still_waiting_for_members():
    buf = GroupBuffer(default_size=3, timeout_s=10)
    buf.add(cand("a", 0))
    buf.add(cand("a", 1))
    buf.add(cand("b", 0))
    buf.note_dropped("b", "b-1", sample_index=1)  # dropped on arrival: not held
    assert len(buf) == 2 and buf.held_samples() == 3
    buf.add(cand("a", 2))  # completes a: it leaves the buffer for training
    assert len(buf) == 1 and buf.held_samples() == 1


def test_the_trajectorys_own_group_size_wins_over_the_configured_one():
    buf = GroupBuffer(default_size=8, timeout_s=10)
    assert buf.add(cand("g", 0, group_size=2)) is None
    assert buf.add(cand("g", 1, group_size=2)) is not None


def test_a_member_dropped_on_arrival_fills_its_slot():
    buf = GroupBuffer(default_size=3, timeout_s=10)
    buf.add(cand("g", 0))
    buf.add(cand("g", 1))
    group = buf.note_dropped("g", "g-2", sample_index=2)
    assert group is not None and len(group.members) == 2 and group.dropped == {"g-2"}


def test_an_aborted_sample_leaves_its_slot_open_for_the_workers_rerun():
    buf = GroupBuffer(default_size=3, timeout_s=10)
    buf.add(cand("g", 0))
    buf.add(cand("g", 1))
    assert buf.note_dropped("g", "g-2", sample_index=2, rerun_expected=True) is None
    rerun = cand("g", 2)
    group = buf.add(rerun)
    assert group is not None and [c.sample_index for c in group.samples()] == [0, 1, 2]


def test_a_second_trained_member_for_one_sample_is_dropped_as_a_duplicate():
    buf = GroupBuffer(default_size=3, timeout_s=10)
    buf.add(cand("g", 0))
    other = cand("g", 0)
    other.sample.trajectory_id = "g-0-r2"
    with pytest.raises(Rejected) as info:
        buf.add(other)
    assert info.value.reason == "duplicate_sample"


def test_an_incomplete_group_is_closed_after_the_timeout():
    clock = Clock()
    buf = GroupBuffer(default_size=4, timeout_s=5, clock=clock)
    buf.add(cand("g", 0))
    clock.now = 4.9
    assert buf.expire() == []
    clock.now = 5.0
    (group,) = buf.expire()
    assert group.timed_out and len(group.members) == 1 and len(buf) == 0


def test_a_member_arriving_after_its_group_closed_is_rejected_as_late():
    buf = GroupBuffer(default_size=1, timeout_s=5)
    buf.add(cand("g", 0))
    with pytest.raises(Rejected) as info:
        buf.add(cand("g", 1))
    assert info.value.reason == "late_for_group" and not info.value.invalid


def test_members_disagreeing_on_the_group_size_are_rejected():
    buf = GroupBuffer(default_size=8, timeout_s=5)
    buf.add(cand("g", 0, group_size=4))
    with pytest.raises(Rejected) as info:
        buf.add(cand("g", 1, group_size=3))
    assert info.value.reason == "group_size_mismatch"


def screen(members, version=0, max_staleness=4, timed_out=False, **cfg):
    filters = GroupFilters(GroupFilterConfig(**cfg), max_staleness)
    return filters.screen_members(members, version, timed_out=timed_out)


def test_a_group_whose_rewards_are_all_equal_is_dropped_and_counted_per_trajectory():
    out = screen([cand("g", k, reward=1.0) for k in range(4)])
    assert out.kept == [] and [r for _, r in out.dropped] == ["all_equal_rewards"] * 4


def test_all_equal_rewards_are_kept_when_that_filter_is_off():
    assert len(screen([cand("g", k, reward=1.0) for k in range(4)], drop_all_equal_rewards=False).kept) == 4


def test_a_group_with_fewer_than_min_samples_is_dropped():
    out = screen([cand("g", 0, reward=1.0)], min_samples=2)
    assert out.kept == [] and out.dropped[0][1] == "too_few_samples"


def test_stale_trajectory_is_dropped_after_max_staleness():
    members = [cand("g", 0, 1.0, version=6), cand("g", 1, 0.0, version=6), cand("g", 2, 1.0, version=5)]
    out = screen(members, version=10, max_staleness=4)
    assert [c.sample_index for c in out.kept] == [0, 1]
    assert [(c.sample_index, r) for c, r in out.dropped] == [(2, "stale")]


def test_staleness_can_leave_a_group_too_small_to_train():
    out = screen([cand("g", 0, 1.0, version=0), cand("g", 1, 0.0, version=9)], version=9, max_staleness=2)
    assert out.kept == [] and sorted(r for _, r in out.dropped) == ["stale", "too_few_samples"]


def test_a_trajectory_without_generated_spans_is_never_stale():
    assert len(screen([cand("g", 0, 1.0, version=None), cand("g", 1, 0.0, version=None)],
                      version=100).kept) == 2


def test_a_timed_out_group_is_trained_or_dropped_as_configured():
    members = [cand("g", 0, 1.0), cand("g", 1, 0.0)]
    assert len(screen(members, timed_out=True, on_timeout="train").kept) == 2
    out = screen(members, timed_out=True, on_timeout="drop")
    assert out.kept == [] and {r for _, r in out.dropped} == {"group_timeout"}


def test_equal_rewards_are_kept_for_ppo_whose_advantages_do_not_depend_on_the_group():
    filters = GroupFilters(GroupFilterConfig(), max_staleness=4, group_relative=False)
    assert len(filters.screen_members([cand("g", k, reward=1.0) for k in range(4)], 0).kept) == 4
