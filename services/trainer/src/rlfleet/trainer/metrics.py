"""The trainer's Prometheus metrics (through OpenTelemetry), all named rlfleet_trainer_<what>_<unit>.

Step metrics come from the learning core (losses.py); log-probs, entropy and KL are in nats.
"""

from __future__ import annotations

from rlfleet.common.telemetry import meter, seconds_histogram

STALENESS_BUCKETS = [0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64]

# gauge name -> key in the step metrics
STEP_GAUGES = {
    "rlfleet_trainer_loss_value": "loss",
    "rlfleet_trainer_entropy_nats": "entropy",
    "rlfleet_trainer_clip_fraction_ratio": "clip_frac",
    "rlfleet_trainer_approx_kl_nats": "approx_kl",
    "rlfleet_trainer_kl_nats": "kl",
    "rlfleet_trainer_grad_norm_value": "grad_norm",
    "rlfleet_trainer_logprob_gap_nats": "logprob_gap_mean",
    "rlfleet_trainer_reward_mean_value": "reward_mean",
    "rlfleet_trainer_learning_rate_value": "lr",
    "rlfleet_trainer_step_tokens_per_second": "tokens_per_s",
}


class TrainerMetrics:
    def __init__(self) -> None:
        m = meter("rlfleet.trainer")
        self._gauges = {key: m.create_gauge(name, description=f"last optimizer step's {key}")
                        for name, key in STEP_GAUGES.items()}
        self.steps = m.create_counter("rlfleet_trainer_steps_total", description="optimizer steps taken")
        self.trained = m.create_counter("rlfleet_trainer_trained_trajectories_total",
                                        description="trajectories trained on")
        self.tokens = m.create_counter("rlfleet_trainer_trained_tokens_total",
                                       description="tokens trained on")
        self.dropped = m.create_counter("rlfleet_trainer_dropped_trajectories_total",
                                        description="trajectories not trained, by reason")
        self.staleness = m.create_histogram(
            "rlfleet_trainer_staleness_versions", unit="1", description="trainer version minus the oldest "
            "generated span's version, per trained trajectory",
            explicit_bucket_boundaries_advisory=STALENESS_BUCKETS)
        self.step_time = seconds_histogram(m, "rlfleet_trainer_step_duration_seconds",
                                           "optimizer step: batch assembly, old log-probs, "
                                           "forward, backward, update")
        self.checkpoint_time = seconds_histogram(m, "rlfleet_trainer_checkpoint_duration_seconds",
                                                 "writing a durable checkpoint")
        self.publish_time = seconds_histogram(m, "rlfleet_trainer_publish_duration_seconds",
                                              "writing a version to the weight store and announcing it")
        self.idle = m.create_gauge("rlfleet_trainer_idle_ratio",
                                   description="share of (unpaused) wall time spent waiting for data")
        self.wait = m.create_counter("rlfleet_trainer_data_wait_seconds_total", unit="s",
                                     description="time spent waiting for complete groups")
        self.version = m.create_gauge("rlfleet_trainer_policy_version_number",
                                      description="policy version the trainer holds")
        self.pending_groups = m.create_gauge("rlfleet_trainer_pending_groups_count",
                                             description="incomplete groups held in memory")

    def step(self, metrics: dict[str, float], staleness: list[int], seqs: int) -> None:
        for key, gauge in self._gauges.items():
            if key in metrics:
                gauge.set(metrics[key])
        self.steps.add(1)
        self.trained.add(seqs)
        self.tokens.add(int(metrics.get("tokens", 0)))
        self.step_time.record(metrics.get("rl_step_s", metrics.get("step_time_s", 0.0)))
        for s in staleness:
            self.staleness.record(s)
