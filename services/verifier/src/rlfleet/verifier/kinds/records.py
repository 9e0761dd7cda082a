"""The records a verifier kind reads (an episode) and writes (a verdict with reasons)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum


class ReasonCode(StrEnum):
    """Mirrors ``rlfleet.common.v1.ReasonCode`` without its prefix; a clean pass has no reason."""

    WRONG_ANSWER = "WRONG_ANSWER"
    NO_ANSWER = "NO_ANSWER"
    TEST_FAILED = "TEST_FAILED"
    TIMEOUT = "TIMEOUT"
    INVALID_TOOL_CALL = "INVALID_TOOL_CALL"
    SAFETY_VIOLATION = "SAFETY_VIOLATION"
    TRUNCATED = "TRUNCATED"
    VERIFIER_ERROR = "VERIFIER_ERROR"
    EXCEPTION = "EXCEPTION"
    REWARD_HACKING = "REWARD_HACKING"
    OTHER = "OTHER"


@dataclass(frozen=True)
class Reason:
    code: ReasonCode
    message: str
    details: dict[str, str] = field(default_factory=dict)


@dataclass
class Verdict:
    reward: float
    passed: bool
    reasons: list[Reason] = field(default_factory=list)
    kind: str = ""

    @property
    def codes(self) -> list[ReasonCode]:
        return [reason.code for reason in self.reasons]


@dataclass(frozen=True)
class ToolCallRecord:
    """One executed tool call, as the sandbox ran it. ``ok`` is False when the tool reported an error."""

    tool: str
    args: str
    observation: str = ""
    ok: bool = True


@dataclass(frozen=True)
class Violation:
    """A sandbox violation record; ``kind`` as in ``rlfleet.sandbox.v1.ViolationKind``, lower case."""

    kind: str
    message: str = ""


@dataclass
class Episode:
    """What the verifier knows of one episode.

    ``assistant_texts`` are the decoded assistant turns in order; when present, the answer and the
    tool-call checks come from them (the verifier does not trust a client's parse). ``answer`` is
    only used when there are no texts (offline scoring of a bare answer). ``tool_calls`` are the
    executed calls in order, ``files`` the candidate files read from the policy's sandbox.
    """

    assistant_texts: list[str] = field(default_factory=list)
    answer: str | None = None
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    files: Mapping[str, bytes | str] = field(default_factory=dict)
    timed_out: bool = False
    truncated: bool = False
