"""The verifier-kind interface and the reward rules every kind shares.

A kind decides only whether the outcome is right (``check``). The rules every kind shares live in
:meth:`VerifierKind.score`, so rewards mean the same thing across suites:

- ``passed`` = the kind found no failure, the episode did not time out, and the sandbox recorded no
  safety violation.
- ``reward`` = ``pass_reward`` (1.0) if passed else ``fail_reward`` (0.0), minus
  ``invalid_tool_call_penalty`` (0.05) per invalid tool call, capped at
  ``max_invalid_tool_call_penalty`` (0.2), minus ``safety_violation_penalty`` (0.2) when there was
  a safety violation. Invalid tool calls alone do not fail an episode: they cost a little, so that
  of two correct episodes the clean one is preferred, without hiding the correct answer.
- ``reasons`` lists every failure and every penalised event; a clean pass has no reasons.

Tasks are suite records as plain mappings (one JSONL line, ``json.loads``-ed; a pydantic task is
dumped first), so this package needs nothing from the environment SDK.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlfleet.verifier.kinds.records import Episode, Reason, ReasonCode, Verdict
from rlfleet.verifier.kinds.turns import read_turns

# Must equal the suite format's default `limits.max_turns` (a contract test checks it).
DEFAULT_MAX_TURNS = 4


@dataclass(frozen=True)
class ScoringConfig:
    pass_reward: float = 1.0
    fail_reward: float = 0.0
    invalid_tool_call_penalty: float = 0.05
    max_invalid_tool_call_penalty: float = 0.2
    safety_violation_penalty: float = 0.2
    # Violation kinds that fail the episode. Resource limits (timeout, memory, cpu, output, file
    # size) are enforced by the sandbox and shown to the policy as tool errors, so they do not.
    safety_violation_kinds: frozenset[str] = frozenset({"network", "filesystem", "processes"})


class VerifierKind(ABC):
    """Scores episodes of tasks whose ``verifier.kind`` is :attr:`name`."""

    name: str

    def __init__(self, config: ScoringConfig | None = None) -> None:
        self.config = config or ScoringConfig()

    @abstractmethod
    def check(self, spec: Mapping[str, Any], episode: Episode, answer: str | None) -> list[Reason]:
        """The failures of the outcome (empty when it is right); ``spec`` is the task's ``verifier``."""

    def score(self, task: Mapping[str, Any] | Any, episode: Episode) -> Verdict:
        task = as_task_dict(task)
        spec = task["verifier"]
        if spec.get("kind") != self.name:
            raise ValueError(
                f"task {task.get('task_id')!r} has verifier kind {spec.get('kind')!r}, not {self.name!r}"
            )
        reading = read_turns(episode, tool_names(task), max_turns(task))
        failures = self.check(spec, episode, reading.answer)
        if episode.timed_out:
            failures.append(Reason(ReasonCode.TIMEOUT, "the episode ran past its time limit"))
        if episode.truncated and reading.answer is None:
            failures.append(
                Reason(ReasonCode.TRUNCATED, "the episode hit its token or turn budget before answering")
            )
        safety = [
            Reason(
                ReasonCode.SAFETY_VIOLATION,
                f"sandbox violation: {v.kind}",
                {"kind": v.kind, "message": v.message},
            )
            for v in episode.violations
            if v.kind.lower() in self.config.safety_violation_kinds
        ]
        passed = not failures and not safety
        reward = self.config.pass_reward if passed else self.config.fail_reward
        reward -= min(
            len(reading.invalid) * self.config.invalid_tool_call_penalty,
            self.config.max_invalid_tool_call_penalty,
        )
        reward -= self.config.safety_violation_penalty if safety else 0.0
        return Verdict(
            reward=reward, passed=passed, reasons=failures + safety + reading.invalid, kind=self.name
        )


def as_task_dict(task: Mapping[str, Any] | Any) -> Mapping[str, Any]:
    """A suite record as a mapping; pydantic models (the SDK's ``Task``) are dumped to JSON form."""
    if hasattr(task, "model_dump"):
        return task.model_dump(mode="json")
    if not isinstance(task, Mapping):
        raise TypeError(f"a task must be a mapping or a pydantic model, got {type(task).__name__}")
    return task


def tool_names(task: Mapping[str, Any]) -> list[str]:
    return [tool["name"] for tool in task.get("tools", ())]


def max_turns(task: Mapping[str, Any]) -> int:
    return int(task.get("limits", {}).get("max_turns", DEFAULT_MAX_TURNS))
