"""What is not trained, and why: staleness per trajectory, then filters per group.

Every drop has a reason (the key of `dropped_by_reason`, counted per trajectory):

- `stale`: the oldest generated span is more than `max_staleness` versions behind the trainer;
  checked when a trajectory arrives and again when its group is about to be trained, since the
  trainer moves on while a group waits;
- `too_few_samples`: fewer than `min_samples` trainable members (a timed-out or thinned group);
- `all_equal_rewards`: every member has the same reward, so every group-relative advantage is 0
  and the step would only spend compute (and dilute the token mean); not applied with PPO, whose
  GAE advantages do not vanish;
- `group_timeout`: the group did not complete in time and `on_timeout = "drop"`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from rlfleet.trainer.groups import Group
from rlfleet.trainer.service_config import GroupFilterConfig
from rlfleet.trainer.validation import Candidate


class GroupFilter(Protocol):
    @property
    def reason(self) -> str:
        """Why a group this filter drops was dropped (a metric label)."""

    def drops(self, members: Sequence[Candidate]) -> bool: ...


@dataclass(frozen=True)
class MinSamples:
    n: int
    reason: str = "too_few_samples"

    def drops(self, members: Sequence[Candidate]) -> bool:
        return len(members) < self.n


@dataclass(frozen=True)
class AllEqualRewards:
    reason: str = "all_equal_rewards"

    def drops(self, members: Sequence[Candidate]) -> bool:
        return len({c.sample.reward for c in members}) <= 1


@dataclass(frozen=True)
class Staleness:
    max_staleness: int
    reason: str = "stale"

    def of(self, c: Candidate, trainer_version: int) -> int:
        return 0 if c.oldest_version is None else max(trainer_version - c.oldest_version, 0)

    def is_stale(self, c: Candidate, trainer_version: int) -> bool:
        return self.of(c, trainer_version) > self.max_staleness


@dataclass
class Screened:
    """A group after screening: the members to train (empty when the group is dropped) and the drops."""

    kept: list[Candidate]
    dropped: list[tuple[Candidate, str]] = field(default_factory=list)


class GroupFilters:
    def __init__(self, cfg: GroupFilterConfig, max_staleness: int, group_relative: bool = True) -> None:
        """`group_relative`: the loss's advantages are relative to the group (GRPO, GSPO; not PPO's GAE)."""
        self.cfg = cfg
        self.staleness = Staleness(max_staleness)
        self.filters: list[GroupFilter] = [MinSamples(cfg.min_samples)]
        if cfg.drop_all_equal_rewards and group_relative:
            self.filters.append(AllEqualRewards())

    def screen(self, group: Group, trainer_version: int) -> Screened:
        return self.screen_members(group.samples(), trainer_version, timed_out=group.timed_out)

    def screen_members(self, members: Sequence[Candidate], trainer_version: int,
                       timed_out: bool = False) -> Screened:
        if timed_out and self.cfg.on_timeout == "drop":
            return Screened([], [(c, "group_timeout") for c in members])
        out = Screened([])
        for c in members:
            if self.staleness.is_stale(c, trainer_version):
                out.dropped.append((c, self.staleness.reason))
            else:
                out.kept.append(c)
        for f in self.filters:
            if out.kept and f.drops(out.kept):
                out.dropped += [(c, f.reason) for c in out.kept]
                out.kept = []
        return out
