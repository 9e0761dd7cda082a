"""Verifier scoring kinds as pure functions: ``kind.score(task, episode) -> Verdict``.

No gRPC or sandboxes here: the verifier service wraps these, giving ``unit_tests`` a runner that
executes hidden tests in a sandbox of their own.
"""

from rlfleet.verifier.kinds.answers import ExactKind, NumericKind, normalise_text, parse_number
from rlfleet.verifier.kinds.audit import AuditReport, Disagreement, LabelledEpisode, audit
from rlfleet.verifier.kinds.base import ScoringConfig, VerifierKind
from rlfleet.verifier.kinds.records import Episode, Reason, ReasonCode, ToolCallRecord, Verdict, Violation
from rlfleet.verifier.kinds.registry import (
    KIND_NAMES,
    KindRegistry,
    Scorer,
    UnknownVerifierKind,
    default_kinds,
)
from rlfleet.verifier.kinds.unit_tests import (
    TestRunner,
    TestRunRequest,
    TestRunResult,
    UnitTestsKind,
    harness_request,
    judge,
    run_locally,
)

__all__ = [
    "KIND_NAMES",
    "AuditReport",
    "Disagreement",
    "Episode",
    "ExactKind",
    "KindRegistry",
    "LabelledEpisode",
    "NumericKind",
    "Reason",
    "ReasonCode",
    "Scorer",
    "ScoringConfig",
    "TestRunRequest",
    "TestRunResult",
    "TestRunner",
    "ToolCallRecord",
    "UnitTestsKind",
    "UnknownVerifierKind",
    "Verdict",
    "VerifierKind",
    "Violation",
    "audit",
    "default_kinds",
    "harness_request",
    "judge",
    "normalise_text",
    "parse_number",
    "run_locally",
]
