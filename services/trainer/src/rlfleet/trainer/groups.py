"""Collecting the G samples of a task into a group.

A group has G slots, one per sample index. It is complete when every slot holds a trained member
or a member dropped for good on arrival (a stale one, an invalid one): those never come again, so
waiting for them would only hold the others. An *aborted* sample is different: the rollout worker
runs it again under the same group and sample index (its task is redelivered), so its slot stays
open for the re-run. A group that is still incomplete `timeout_s` after its first sample arrived is
closed as it is; the caller decides whether to train or drop it (config `group_filter.on_timeout`).
Closed groups are remembered (bounded) so that a member arriving after its group was trained is
dropped as `late_for_group` instead of opening a group of one.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from rlfleet.trainer.validation import Candidate, Rejected


@dataclass
class Group:
    group_id: str
    expected: int
    first_seen: float
    members: dict[str, Candidate] = field(default_factory=dict)
    dropped: set[str] = field(default_factory=set)  # members dropped on arrival (any reason)
    slots: dict[int, str] = field(default_factory=dict)  # sample index -> member or final drop
    timed_out: bool = False

    @property
    def arrived(self) -> int:
        return len(self.slots)

    @property
    def complete(self) -> bool:
        return self.arrived >= self.expected

    def samples(self) -> list[Candidate]:
        """Members in a fixed order (sample index, then ID), whatever order they arrived in."""
        return sorted(self.members.values(), key=lambda c: (c.sample_index, c.trajectory_id))


class GroupBuffer:
    def __init__(self, default_size: int, timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 remember_closed: int = 100_000) -> None:
        self.default_size = default_size
        self.timeout_s = timeout_s
        self.clock = clock
        self.remember_closed = remember_closed
        self._open: dict[str, Group] = {}
        self._closed: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._open)

    def held_samples(self) -> int:
        """Samples waiting in open groups for the rest of their group."""
        return sum(len(g.members) for g in self._open.values())

    def add(self, c: Candidate) -> Group | None:
        """Adds a validated sample; returns its group when this sample completes it."""
        group = self._group(c.group_id, c.trajectory_id, c.group_size)
        if c.group_size and c.group_size != group.expected:
            raise Rejected("group_size_mismatch", f"trajectory {c.trajectory_id}: group_size {c.group_size}, "
                           f"group {c.group_id} has {group.expected}", trajectory_id=c.trajectory_id,
                           group_id=c.group_id)
        holder = group.slots.get(c.sample_index)
        if holder is not None and holder in group.members:
            raise Rejected("duplicate_sample", f"trajectory {c.trajectory_id}: sample {c.sample_index} of "
                           f"group {c.group_id} was already trained as {holder}", invalid=False,
                           trajectory_id=c.trajectory_id, group_id=c.group_id)
        group.members[c.trajectory_id] = c
        group.slots[c.sample_index] = c.trajectory_id
        return self._close_if_complete(group)

    def note_dropped(self, group_id: str, trajectory_id: str, group_size: int = 0,
                     sample_index: int | None = None, rerun_expected: bool = False) -> Group | None:
        """A member dropped on arrival fills its slot for good, unless a re-run of it is expected
        (an aborted sample); returns the group if this completes it."""
        if not group_id or group_id in self._closed:
            return None
        group = self._group(group_id, trajectory_id, group_size)
        group.dropped.add(trajectory_id)
        if rerun_expected:
            return None
        # unknown index: a slot of its own
        slot = sample_index if sample_index is not None else -len(group.dropped)
        group.slots.setdefault(slot, trajectory_id)
        return self._close_if_complete(group)

    def expire(self) -> list[Group]:
        """Closes and returns the groups that waited longer than timeout_s."""
        now = self.clock()
        late = [g for g in self._open.values() if now - g.first_seen >= self.timeout_s]
        for g in late:
            g.timed_out = True
            self._close(g)
        return late

    def drain(self) -> list[Group]:
        """Every open group (at shutdown)."""
        groups = list(self._open.values())
        self._open.clear()
        return groups

    def is_closed(self, group_id: str) -> bool:
        return group_id in self._closed

    def _group(self, group_id: str, trajectory_id: str, group_size: int) -> Group:
        if group_id in self._closed:
            raise Rejected("late_for_group",
                           f"trajectory {trajectory_id}: group {group_id} was already closed", invalid=False,
                           trajectory_id=trajectory_id, group_id=group_id)
        group = self._open.get(group_id)
        if group is None:
            group = self._open[group_id] = Group(group_id, group_size or self.default_size, self.clock())
        return group

    def _close_if_complete(self, group: Group) -> Group | None:
        if not group.complete:
            return None
        self._close(group)
        return group

    def _close(self, group: Group) -> None:
        self._open.pop(group.group_id, None)
        self._closed[group.group_id] = None
        while len(self._closed) > self.remember_closed:
            self._closed.popitem(last=False)
