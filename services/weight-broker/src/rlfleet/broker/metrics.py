"""The broker's OpenTelemetry instruments (served for Prometheus by the shared telemetry setup)."""

from __future__ import annotations

from rlfleet.broker.transports import UpdateOutcome
from rlfleet.common.telemetry import meter, seconds_histogram

BYTES_BUCKETS = [float(1 << n) for n in range(10, 41, 2)]  # 1 KiB .. 1 TiB
RATIO_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0]


class BrokerMetrics:
    def __init__(self) -> None:
        m = meter("rlfleet.broker")
        self.pause = seconds_histogram(
            m, "rlfleet_broker_pause_seconds",
            "how long an engine stopped generating for one weight update, "
            "by engine and transport")  # fmt: skip
        self.update_bytes = m.create_histogram(
            "rlfleet_broker_update_bytes", unit="By",
            description="bytes shipped to one engine per update (delta payload, full checkpoint read, "
                        "broadcast)",
            explicit_bucket_boundaries_advisory=BYTES_BUCKETS)  # fmt: skip
        self.changed = m.create_histogram(
            "rlfleet_broker_changed_ratio", unit="1",
            description="share of served values a delta update changed",
            explicit_bucket_boundaries_advisory=RATIO_BUCKETS)  # fmt: skip
        self.publish_to_serving = seconds_histogram(
            m, "rlfleet_broker_publish_to_serving_seconds",
            "from the trainer's publish (PolicyVersion.created_unix_ms) to every fleet engine serving the "
            "version")  # fmt: skip
        self.updates = m.create_counter(
            "rlfleet_broker_updates_total", description="engine weight updates, by transport and outcome")
        self.fallbacks = m.create_counter(
            "rlfleet_broker_fallbacks_total",
            description="delta updates an engine refused that fell back to a full load")

    def record(self, outcome: UpdateOutcome) -> None:
        attrs = {"transport": outcome.transport}
        result = "ok" if outcome.ok else ("refused" if outcome.refused else "unavailable")
        self.updates.add(1, {**attrs, "outcome": result})
        if not outcome.ok:
            return
        self.pause.record(outcome.pause_s, {**attrs, "engine_id": outcome.engine_id})
        self.update_bytes.record(outcome.bytes, attrs)
        if outcome.transport == "disk_delta" and outcome.changed_fraction is not None:
            self.changed.record(float(outcome.changed_fraction), attrs)
