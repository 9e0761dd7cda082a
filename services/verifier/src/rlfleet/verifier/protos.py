"""Verdicts and audit reports as the public protos."""

from __future__ import annotations

import time

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.verifier.v1 import verifier_pb2
from rlfleet.verifier.kinds import AuditReport, Reason, Verdict


def reason_proto(reason: Reason) -> common_pb2.FailureReason:
    return common_pb2.FailureReason(code=common_pb2.ReasonCode.Value(f"REASON_CODE_{reason.code.value}"),
                                    message=reason.message,
                                    details={k: str(v) for k, v in reason.details.items()})


def verdict_proto(verdict: Verdict, *, session_id: str, task_id: str, verify_s: float) -> common_pb2.Verdict:
    return common_pb2.Verdict(
        schema_version=common_pb2.SCHEMA_VERSION_1, session_id=session_id, task_id=task_id,
        reward=verdict.reward, passed=verdict.passed, reasons=[reason_proto(r) for r in verdict.reasons],
        verifier_kind=verdict.kind, created_unix_ms=int(time.time() * 1000), verify_s=verify_s)


def audit_report_proto(report: AuditReport) -> verifier_pb2.AuditReport:
    return verifier_pb2.AuditReport(
        n=report.n, true_positives=report.tp, false_positives=report.fp, true_negatives=report.tn,
        false_negatives=report.fn, false_positive_rate=report.false_positive_rate,
        false_negative_rate=report.false_negative_rate,
        disagreements=[verifier_pb2.Disagreement(episode_id=d.episode_id, task_id=d.task_id,
                                                 human_passed=d.human_passed,
                                                 verifier_passed=d.verifier_passed,
                                                 reasons=[reason_proto(r) for r in d.reasons])
                       for d in report.disagreements],
        suites=[verifier_pb2.SuiteAudit(suite=name, n=r.n, true_positives=r.tp, false_positives=r.fp,
                                        true_negatives=r.tn, false_negatives=r.fn,
                                        false_positive_rate=r.false_positive_rate,
                                        false_negative_rate=r.false_negative_rate)
                for name, r in sorted(report.by_suite.items())])
