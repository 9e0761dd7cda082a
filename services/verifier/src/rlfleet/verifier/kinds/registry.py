"""Picks the kind named by a task's ``verifier.kind``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from rlfleet.verifier.kinds.answers import ExactKind, NumericKind
from rlfleet.verifier.kinds.base import ScoringConfig, VerifierKind, as_task_dict
from rlfleet.verifier.kinds.records import Episode, Verdict
from rlfleet.verifier.kinds.unit_tests import TestRunner, UnitTestsKind

KIND_NAMES = ("exact", "numeric", "unit_tests")


class Scorer(Protocol):
    """Anything that scores an episode of a task: one kind, or a :class:`KindRegistry`."""

    def score(self, task: Mapping[str, Any] | Any, episode: Episode) -> Verdict: ...


class UnknownVerifierKind(KeyError):
    def __init__(self, kind: str, known: list[str]) -> None:
        super().__init__(kind)
        self.kind = kind
        self.known = known

    def __str__(self) -> str:
        return f"no verifier kind {self.kind!r} is configured (configured: {', '.join(self.known)})"


class KindRegistry:
    """Scores any task by dispatching on its ``verifier.kind``."""

    def __init__(self, kinds: Mapping[str, VerifierKind]) -> None:
        self.kinds = dict(kinds)

    def kind_for(self, task: Mapping[str, Any] | Any) -> VerifierKind:
        name = str(as_task_dict(task)["verifier"].get("kind"))
        if name not in self.kinds:
            raise UnknownVerifierKind(name, sorted(self.kinds))
        return self.kinds[name]

    def score(self, task: Mapping[str, Any] | Any, episode: Episode) -> Verdict:
        return self.kind_for(task).score(task, episode)


def default_kinds(runner: TestRunner | None = None, config: ScoringConfig | None = None) -> KindRegistry:
    """``exact`` and ``numeric``, plus ``unit_tests`` when a test runner is given."""
    kinds: dict[str, VerifierKind] = {"exact": ExactKind(config), "numeric": NumericKind(config)}
    if runner is not None:
        kinds["unit_tests"] = UnitTestsKind(runner, config)
    return KindRegistry(kinds)
