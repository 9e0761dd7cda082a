"""The verifier's metrics (served for Prometheus by the shared telemetry setup)."""

from __future__ import annotations

from rlfleet.api.common.v1 import common_pb2
from rlfleet.common.telemetry import RewardHistograms, meter, seconds_histogram


class VerifierMetrics:
    """rlfleet_verifier_verdicts_total{passed, reason, kind} (reason: the first reason code, "none" for a
    clean pass), rlfleet_verifier_reasons_total{code}, rlfleet_verifier_reward and rlfleet_verifier_penalty
    (histograms: `RewardHistograms`),
    rlfleet_verifier_verify_latency_seconds{kind}."""

    def __init__(self) -> None:
        m = meter("rlfleet.verifier")
        self.verdicts = m.create_counter("rlfleet_verifier_verdicts_total", description="verdicts given")
        self.reasons = m.create_counter("rlfleet_verifier_reasons_total",
                                        description="failure reasons, by code")
        self.reward = RewardHistograms(m, "rlfleet_verifier", "rewards given")
        self.latency = seconds_histogram(m, "rlfleet_verifier_verify_latency_seconds",
                                         "time to score one episode")

    def record(self, verdict: common_pb2.Verdict) -> None:
        codes = [common_pb2.ReasonCode.Name(r.code).removeprefix("REASON_CODE_") for r in verdict.reasons]
        self.verdicts.add(1, {"passed": str(verdict.passed).lower(), "reason": codes[0] if codes else "none",
                              "kind": verdict.verifier_kind})
        for code in codes:
            self.reasons.add(1, {"code": code})
        self.reward.record(verdict.reward, {"kind": verdict.verifier_kind})
        self.latency.record(verdict.verify_s, {"kind": verdict.verifier_kind})
