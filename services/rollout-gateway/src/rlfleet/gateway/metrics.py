"""The gateway's OpenTelemetry instruments (served for Prometheus by the shared telemetry setup)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Observation

from rlfleet.api.gateway.v1 import gateway_pb2
from rlfleet.common.telemetry import meter, seconds_histogram
from rlfleet.gateway.registry import EngineRecord


class GatewayMetrics:
    """Per engine (labels engine_id, pool): rlfleet_gateway_engine_policy_version,
    rlfleet_gateway_engine_in_flight_requests and rlfleet_gateway_engine_busy_seconds_total, whose
    rate is the engine's utilisation as this replica sees it (share of time with a request on it)."""

    def __init__(self, engines: Callable[[], Iterable[EngineRecord]],
                 busy_seconds: Callable[[str], float] = lambda engine_id: 0.0,
                 local_in_flight: Callable[[str], int] = lambda engine_id: 0) -> None:
        m = meter("rlfleet.gateway")
        self.generate_seconds = seconds_histogram(
            m, "rlfleet_gateway_generate_seconds", "engine round trip of one generate call")
        self.generated_tokens = m.create_counter(
            "rlfleet_gateway_generated_tokens_total", description="tokens generated through the gateway")
        self.reroutes = m.create_counter(
            "rlfleet_gateway_reroutes_total", description="turns sent to another engine than the session's")
        self.engine_failures = m.create_counter(
            "rlfleet_gateway_engine_failures_total",
            description="generate calls an engine failed (unreachable, 5xx)")
        self.admissions = m.create_counter(
            "rlfleet_gateway_admission_decisions_total", description="Admit answers, by outcome")

        def engine_states(_options: CallbackOptions) -> Iterable[Observation]:
            counts: dict[str, int] = {}
            for engine in engines():
                counts[engine.state_name] = counts.get(engine.state_name, 0) + 1
            return [Observation(n, {"state": state}) for state, n in counts.items()]

        m.create_observable_gauge("rlfleet_gateway_engines", [engine_states], description="engines by state")

        def labels(engine: EngineRecord) -> dict[str, str]:
            return {"engine_id": engine.engine_id, "pool": _pool_name(engine.pool)}

        def versions(_options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(e.policy_version, labels(e)) for e in engines()]

        def in_flight(_options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(max(e.in_flight, local_in_flight(e.engine_id)), labels(e)) for e in engines()]

        def busy(_options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(busy_seconds(e.engine_id), labels(e)) for e in engines()]

        m.create_observable_gauge("rlfleet_gateway_engine_policy_version", [versions],
                                  description="policy version the engine serves (-1: unknown yet)")
        m.create_observable_gauge("rlfleet_gateway_engine_in_flight_requests", [in_flight],
                                  description="running + waiting requests on the engine at the last probe")
        m.create_observable_counter("rlfleet_gateway_engine_busy_seconds_total", [busy], unit="s",
                                    description="time with at least one generate call from this gateway on "
                                                "the engine; its rate is the engine's utilisation")


def _pool_name(pool: int) -> str:
    return gateway_pb2.EnginePool.Name(pool).removeprefix("ENGINE_POOL_").lower()
