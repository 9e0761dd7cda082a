"""What one episode came to: the verdict's reward and the counts the worker reports as metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlfleet.api.common.v1 import common_pb2

# How the turn loop ended.
END_ANSWER = "answer"          # a final answer
END_NO_ACTION = "no_action"    # a turn without any tag
END_TURN_LIMIT = "turn_limit"  # max_turns + 1 turns used without an answer
END_BUDGET = "budget"          # the session's token budget is spent
END_TIMEOUT = "timeout"        # the episode's time limit
END_ERROR = "error"            # the environment failed (not the policy)
END_CANCELLED = "cancelled"    # stopped from outside (worker shutdown)

SAFETY_VIOLATION_KINDS = frozenset({"network", "filesystem", "processes"})


@dataclass
class EpisodeSummary:
    session_id: str
    task_id: str
    suite: str
    group_id: str = ""
    sample_index: int = 0
    end: str = ""
    status: int = common_pb2.TRAJECTORY_STATUS_UNSPECIFIED
    reward: float = 0.0
    passed: bool = False
    reasons: list[str] = field(default_factory=list)  # ReasonCode names of the verdict
    final_answer: str | None = None
    turns: int = 0  # Generate calls
    tool_calls: int = 0  # calls run in the sandbox
    invalid_calls: int = 0  # malformed, unknown tool, rejected by the tool, beyond max_turns
    violations: list[str] = field(default_factory=list)  # sandbox violation kinds, lower case
    tool_wait_s: float = 0.0
    generate_s: float = 0.0
    # creating, setting up and destroying the episode's sandbox (tool calls not counted)
    sandbox_s: float = 0.0
    verify_s: float = 0.0  # the Verify call (hidden tests included)
    episode_s: float = 0.0
    tools: dict[str, int] = field(default_factory=dict)  # calls run, by tool name
    trajectory_id: str = ""
    sandbox_id: str = ""
    error: str = ""
    platform_failure: bool = False  # it failed because a service was down or full, not because of the task

    @property
    def status_name(self) -> str:
        return common_pb2.TrajectoryStatus.Name(self.status).removeprefix("TRAJECTORY_STATUS_").lower()

    @property
    def safety_violations(self) -> int:
        return sum(1 for kind in self.violations if kind in SAFETY_VIOLATION_KINDS)

    @property
    def outcome(self) -> str:
        """One word for dashboards: passed, failed, timeout, error or aborted."""
        if self.status == common_pb2.TRAJECTORY_STATUS_FAILED or self.end == END_ERROR:
            return "error"
        if self.status == common_pb2.TRAJECTORY_STATUS_ABORTED or self.end == END_CANCELLED:
            return "aborted"
        if self.end == END_TIMEOUT:
            return "timeout"
        return "passed" if self.passed else "failed"

    def apply_verdict(self, verdict: common_pb2.Verdict) -> None:
        self.reward = verdict.reward
        self.passed = verdict.passed
        self.reasons = [common_pb2.ReasonCode.Name(r.code).removeprefix("REASON_CODE_")
                        for r in verdict.reasons]
