"""How often a verifier agrees with human labels: the false-positive and false-negative rates.

"Positive" means *passed*. A false positive (the verifier passes what a human failed) is the
expensive error in RL, because it rewards the policy for a wrong behaviour it will then repeat.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rlfleet.verifier.kinds.base import as_task_dict
from rlfleet.verifier.kinds.records import Episode, Reason
from rlfleet.verifier.kinds.registry import Scorer


@dataclass(frozen=True)
class LabelledEpisode:
    task: Mapping[str, Any] | Any
    episode: Episode
    human_passed: bool
    episode_id: str = ""


@dataclass(frozen=True)
class Disagreement:
    episode_id: str
    task_id: str
    human_passed: bool
    verifier_passed: bool
    reasons: list[Reason]


@dataclass
class AuditReport:
    n: int = 0
    tp: int = 0
    fp: int = 0
    tn: int = 0
    fn: int = 0
    disagreements: list[Disagreement] = field(default_factory=list)
    by_suite: dict[str, AuditReport] = field(default_factory=dict)  # the same counts per task suite

    def add(self, human_passed: bool, verifier_passed: bool) -> None:
        self.n += 1
        if verifier_passed and human_passed:
            self.tp += 1
        elif verifier_passed:
            self.fp += 1
        elif human_passed:
            self.fn += 1
        else:
            self.tn += 1

    @property
    def false_positive_rate(self) -> float:
        """FP / (FP + TN): of the episodes humans failed, the share the verifier passed; 0.0 if none."""
        return self.fp / (self.fp + self.tn) if self.fp + self.tn else 0.0

    @property
    def false_negative_rate(self) -> float:
        """FN / (FN + TP): of the episodes humans passed, the share the verifier failed; 0.0 if none."""
        return self.fn / (self.fn + self.tp) if self.fn + self.tp else 0.0


def audit(kind: Scorer, labelled_episodes: Iterable[LabelledEpisode], workers: int = 1) -> AuditReport:
    """Scores every episode (``workers`` at a time: hidden-test runs mostly wait on a sandbox)."""
    items = list(labelled_episodes)
    with ThreadPoolExecutor(max(1, workers)) as pool:
        verdicts = list(pool.map(lambda item: kind.score(item.task, item.episode), items))
    report = AuditReport()
    for item, verdict in zip(items, verdicts, strict=True):
        task = as_task_dict(item.task)
        report.add(item.human_passed, verdict.passed)
        report.by_suite.setdefault(str(task.get("suite", "")),
                                   AuditReport()).add(item.human_passed, verdict.passed)
        if verdict.passed != item.human_passed:
            task_id = str(task.get("task_id", ""))
            report.disagreements.append(
                Disagreement(item.episode_id, task_id, item.human_passed, verdict.passed, verdict.reasons)
            )
    return report
