"""The session server's OpenTelemetry instruments (served for Prometheus by the shared telemetry setup)."""

from __future__ import annotations

from rlfleet.common.telemetry import meter, seconds_histogram

TOKEN_BUCKETS = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]

class SessionMetrics:
    def __init__(self) -> None:
        m = meter("rlfleet.session")
        self.generate_seconds = seconds_histogram(
            m, "rlfleet_session_generate_seconds",
            "one Generate call, end to end (gateway and engine included)")
        self.overhead_seconds = seconds_histogram(
            m, "rlfleet_session_overhead_seconds",
            "what a Generate call adds to the engine round trip: session state, gateway, routing")
        self.sessions_opened = m.create_counter(
            "rlfleet_session_sessions_opened_total", description="sessions opened")
        self.sessions_refused = m.create_counter(
            "rlfleet_session_sessions_refused_total", description="new sessions refused, by reason")
        self.generated_tokens = m.create_counter(
            "rlfleet_session_generated_tokens_total",
            description="tokens appended from the engine (loss mask 1)")
        self.observation_tokens = m.create_counter(
            "rlfleet_session_observation_tokens_total",
            description="tokens appended as observations (loss mask 0)")
        self.trajectories = m.create_counter(
            "rlfleet_session_trajectories_published_total", description="trajectories published, by status")
        self.trajectory_tokens = m.create_histogram(
            "rlfleet_session_trajectory_tokens", unit="1",
            description="tokens per published trajectory (prompt, generated and observations), by status",
            explicit_bucket_boundaries_advisory=TOKEN_BUCKETS)
        self.sessions_expired = m.create_counter(
            "rlfleet_session_sessions_expired_total",
            description="open sessions closed by the server after session_idle_timeout_s without a call")
        self.verdict_missing = m.create_counter(
            "rlfleet_session_verdict_missing_total",
            description="trajectories closed without a verifier verdict (marked; "
                        "the trainer does not train on them)")
        self.release_failures = m.create_counter(
            "rlfleet_session_release_failures_total",
            description="closes whose admission slot could not be released at the gateway "
                        "(retried on the next close)")
