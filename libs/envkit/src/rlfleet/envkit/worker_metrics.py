"""A rollout worker's metrics (Prometheus via the shared telemetry setup; no-ops when none is set up).

rlfleet_worker_tool_wait_seconds, rlfleet_worker_episode_duration_seconds,
rlfleet_worker_episode_turns (interactions per episode), rlfleet_worker_invalid_tool_calls_total,
rlfleet_worker_safety_violations_total{kind}, rlfleet_worker_episode_reward and
rlfleet_worker_episode_penalty (a negative reward's size; `RewardHistograms`),
rlfleet_worker_episodes_total{outcome}, rlfleet_worker_tasks_total{result},
rlfleet_worker_bad_tasks_total{reason}, rlfleet_worker_admission_retries_total,
rlfleet_worker_episodes_in_flight.
"""

from __future__ import annotations

from rlfleet.common.telemetry import RewardHistograms, meter, seconds_histogram
from rlfleet.envkit.sdk.summary import SAFETY_VIOLATION_KINDS, EpisodeSummary

TURN_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 16, 32)


class WorkerMetrics:
    def __init__(self) -> None:
        m = meter("rlfleet.worker")
        self.tool_wait = seconds_histogram(m, "rlfleet_worker_tool_wait_seconds",
                                           "time one tool call took in the sandbox")
        self.episode_duration = seconds_histogram(m, "rlfleet_worker_episode_duration_seconds",
                                                  "admission to close of one episode")
        self.turns = m.create_histogram("rlfleet_worker_episode_turns", unit="1",
                                        description="generate calls (interactions) per episode",
                                        explicit_bucket_boundaries_advisory=list(TURN_BUCKETS))
        self.reward = RewardHistograms(m, "rlfleet_worker_episode",
                                       "the verifier's reward per verified episode")
        self.invalid_calls = m.create_counter("rlfleet_worker_invalid_tool_calls_total",
                                              description="malformed, unknown, rejected or "
                                              "over-limit tool calls")
        self.violations = m.create_counter("rlfleet_worker_safety_violations_total",
                                           description="sandbox safety violations (network, "
                                           "filesystem, processes)")
        self.episodes = m.create_counter("rlfleet_worker_episodes_total",
                                         description="finished episodes, by outcome")
        self.tasks = m.create_counter("rlfleet_worker_tasks_total",
                                      description="settled task deliveries: acked, retried, "
                                      "dead_lettered, superseded")
        self.bad_tasks = m.create_counter("rlfleet_worker_bad_tasks_total",
                                          description="task messages that cannot run, by reason")
        self.admission_retries = m.create_counter("rlfleet_worker_admission_retries_total",
                                                  description="OpenSession/CreateSandbox refusals retried")
        self.in_flight = m.create_up_down_counter("rlfleet_worker_episodes_in_flight",
                                                  description="episodes queued or running in this worker")

    def episode(self, summary: EpisodeSummary) -> None:
        self.episodes.add(1, {"outcome": summary.outcome})
        self.episode_duration.record(summary.episode_s)
        self.turns.record(summary.turns)
        if summary.invalid_calls:
            self.invalid_calls.add(summary.invalid_calls)
        for kind in summary.violations:
            if kind in SAFETY_VIOLATION_KINDS:
                self.violations.add(1, {"kind": kind})
        if summary.outcome in ("passed", "failed", "timeout"):
            self.reward.record(summary.reward)
