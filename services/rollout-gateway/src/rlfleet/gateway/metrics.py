"""The gateway's OpenTelemetry instruments (served for Prometheus by the shared telemetry setup)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Observation

from rlfleet.common.telemetry import meter, seconds_histogram
from rlfleet.gateway.registry import EngineRecord


class GatewayMetrics:
    def __init__(self, engines: Callable[[], Iterable[EngineRecord]]) -> None:
        m = meter("rlfleet.gateway")
        self.generate_seconds = seconds_histogram(
            m, "rlfleet_gateway_generate_seconds", "engine round trip of one generate call")
        self.generated_tokens = m.create_counter(
            "rlfleet_gateway_generated_tokens_total", description="tokens generated through the gateway")
        self.reroutes = m.create_counter(
            "rlfleet_gateway_reroutes_total", description="turns sent to another engine than the session's")
        self.engine_failures = m.create_counter(
            "rlfleet_gateway_engine_failures_total", description="generate calls an engine failed (unreachable, 5xx)")
        self.admissions = m.create_counter(
            "rlfleet_gateway_admission_decisions_total", description="Admit answers, by outcome")

        def engine_states(_options: CallbackOptions) -> Iterable[Observation]:
            counts: dict[str, int] = {}
            for engine in engines():
                counts[engine.state_name] = counts.get(engine.state_name, 0) + 1
            return [Observation(n, {"state": state}) for state, n in counts.items()]

        m.create_observable_gauge("rlfleet_gateway_engines", [engine_states], description="engines by state")
