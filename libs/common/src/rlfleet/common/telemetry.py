"""One OpenTelemetry setup for every process.

Metrics go through the OpenTelemetry API and are served for Prometheus on each process's own
HTTP endpoint (`/metrics`). Traces propagate through gRPC (W3C trace context) always, and are
exported over OTLP only when an endpoint is configured; the exporter's timeouts are short so a
missing collector never stalls start-up or shutdown.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import metrics, trace

from rlfleet.common.config import MetricsConfig, TelemetryConfig

log = logging.getLogger(__name__)


@dataclass
class Telemetry:
    service: str
    metrics_port: int = 0
    _http_server: Any = None
    _tracer_provider: Any = None
    _meter_provider: Any = None
    _closers: list[Any] = field(default_factory=list)

    def shutdown(self, timeout_s: float = 1.0) -> None:
        timeout_ms = int(timeout_s * 1000)
        if self._tracer_provider is not None:
            try:
                self._tracer_provider.force_flush(timeout_millis=timeout_ms)
            finally:
                self._tracer_provider.shutdown()
        if self._meter_provider is not None:
            self._meter_provider.shutdown(timeout_millis=timeout_ms)
        if self._http_server is not None:
            self._http_server.shutdown()
            self._http_server.server_close()


_active: Telemetry | None = None


def setup_telemetry(service: str, telemetry: TelemetryConfig, metrics_config: MetricsConfig) -> Telemetry:
    """Installs global tracer/meter providers; call once per process, before serving."""
    global _active
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    resource = Resource.create({"service.name": service})
    state = Telemetry(service)

    readers = []
    if metrics_config.enabled:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import start_http_server

        readers.append(PrometheusMetricReader())
        try:
            server, _thread = start_http_server(metrics_config.port, addr=metrics_config.host)
        except OSError as exc:
            from rlfleet.common.errors import StartupError

            raise StartupError(f"metrics port {metrics_config.host}:{metrics_config.port}: {exc.strerror}") from None
        state._http_server = server
        state.metrics_port = server.server_port
    state._meter_provider = MeterProvider(resource=resource, metric_readers=readers)
    metrics.set_meter_provider(state._meter_provider)

    tracer_provider = TracerProvider(resource=resource)
    if telemetry.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        exporter = OTLPSpanExporter(endpoint=telemetry.otlp_endpoint, insecure=True,
                                    timeout=telemetry.export_timeout_s)
        tracer_provider.add_span_processor(
            BatchSpanProcessor(exporter, export_timeout_millis=int(telemetry.export_timeout_s * 1000)))
    trace.set_tracer_provider(tracer_provider)
    state._tracer_provider = tracer_provider
    _active = state
    return state


def meter(name: str) -> metrics.Meter:
    return metrics.get_meter(name)


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


# Latency buckets for rollout-scale operations: 1 ms .. ~10 min.
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


def seconds_histogram(m: metrics.Meter, name: str, description: str) -> metrics.Histogram:
    return m.create_histogram(name, unit="s", description=description,
                              explicit_bucket_boundaries_advisory=list(SECONDS_BUCKETS))
