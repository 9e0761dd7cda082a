"""One OpenTelemetry setup for every process.

Metrics go through the OpenTelemetry API and are served for Prometheus on each process's own
HTTP endpoint (`/metrics`). Tracing is on when a process has somewhere to send spans: an OTLP
endpoint (the exporter's timeouts are short so a missing collector never stalls start-up or
shutdown) and/or `telemetry.span_file`, which appends every finished span as a JSON line to a file
(for a laptop without a collector, and for tests). Without either, no span is recorded and neither
servers nor client channels trace their calls: on a CPU-bound fleet every microsecond per RPC is
throughput. `telemetry.sample_ratio` keeps a fraction of the traces (decided at the root, so an
episode's spans are all kept or all dropped).

One trace per episode: the SDK's `AgentLoop.run` opens the root span, every gRPC hop (session
server, gateway, sandbox manager, verifier) continues it through metadata, the gateway passes it to
the engine in HTTP headers, and the session server stores it in the trajectory
(`Trajectory.trace_context`), so the trainer's step span links to each episode it trained on.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import metrics, propagate, trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from rlfleet.common.config import MetricsConfig, TelemetryConfig
from rlfleet.common.errors import StartupError

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

            raise StartupError(f"metrics port {metrics_config.host}:{metrics_config.port}: "
                               f"{exc.strerror}") from None
        state._http_server = server
        state.metrics_port = server.server_port
    state._meter_provider = MeterProvider(resource=resource, metric_readers=readers)
    metrics.set_meter_provider(state._meter_provider)

    if not (telemetry.otlp_endpoint or telemetry.span_file):
        _active = state
        return state
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    tracer_provider = TracerProvider(resource=resource,
                                     sampler=ParentBased(TraceIdRatioBased(telemetry.sample_ratio)))
    if telemetry.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        exporter = OTLPSpanExporter(endpoint=telemetry.otlp_endpoint, insecure=True,
                                    timeout=telemetry.export_timeout_s)
        tracer_provider.add_span_processor(
            BatchSpanProcessor(exporter, export_timeout_millis=int(telemetry.export_timeout_s * 1000)))
    if telemetry.span_file:
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        # Batched, so the event loop never waits on the disk; a short delay keeps the file near live.
        tracer_provider.add_span_processor(BatchSpanProcessor(JsonLinesSpanExporter(telemetry.span_file),
                                                              schedule_delay_millis=200))
    trace.set_tracer_provider(tracer_provider)
    state._tracer_provider = tracer_provider
    _active = state
    return state


def tracing_enabled() -> bool:
    """Whether this process records spans: an SDK tracer provider is installed (by `setup_telemetry`
    with an exporter configured, or by an embedding program or test)."""
    from opentelemetry.sdk.trace import TracerProvider

    return isinstance(trace.get_tracer_provider(), TracerProvider)


def meter(name: str) -> metrics.Meter:
    return metrics.get_meter(name)


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


# Latency buckets for rollout-scale operations: 1 ms .. ~10 min.
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
                   120, 300, 600)


def seconds_histogram(m: metrics.Meter, name: str, description: str) -> metrics.Histogram:
    return m.create_histogram(name, unit="s", description=description,
                              explicit_bucket_boundaries_advisory=list(SECONDS_BUCKETS))


REWARD_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 1.0)
PENALTY_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 1.0)


class RewardHistograms:
    """Rewards as two histograms: `<prefix>_reward` for a reward of 0 or more, `<prefix>_penalty` for
    the size of a negative one. OpenTelemetry histograms take no negative value (the SDK drops it with
    a warning), so one histogram silently lost every penalised episode."""

    def __init__(self, m: metrics.Meter, prefix: str, what: str) -> None:
        self.reward = m.create_histogram(f"{prefix}_reward", unit="1", description=f"{what}, 0 or more",
                                         explicit_bucket_boundaries_advisory=list(REWARD_BUCKETS))
        self.penalty = m.create_histogram(f"{prefix}_penalty", unit="1",
                                          description=f"{what} below 0, as its size (-reward)",
                                          explicit_bucket_boundaries_advisory=list(PENALTY_BUCKETS))

    def record(self, reward: float, attributes: dict[str, str] | None = None) -> None:
        if reward < 0:
            self.penalty.record(-reward, attributes)
        else:
            self.reward.record(reward, attributes)


# -- trace context carried in records (trajectories), not in RPC metadata -------------------------


def current_trace_context() -> dict[str, str]:
    """The active span's W3C trace context (`traceparent`, maybe `tracestate`); empty without one."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def link_to(carrier: Mapping[str, str], attributes: Mapping[str, Any] | None = None) -> trace.Link | None:
    """A span link to the span a record's trace context names; None when it names none (an
    untraced producer, or a malformed header, which must never fail the consumer)."""
    context = trace.get_current_span(propagate.extract(dict(carrier))).get_span_context()
    if not context.is_valid:
        return None
    return trace.Link(context, dict(attributes or {}))


# -- the JSON-lines span file ----------------------------------------------------------------------


def span_record(span: ReadableSpan) -> dict[str, Any]:
    context = span.context
    parent = span.parent
    return {
        "trace_id": f"{context.trace_id:032x}", "span_id": f"{context.span_id:016x}",
        "parent_span_id": f"{parent.span_id:016x}" if parent is not None else None,
        "name": span.name, "kind": span.kind.name,
        "service": span.resource.attributes.get("service.name", ""), "pid": os.getpid(),
        "start_unix_ns": span.start_time, "end_unix_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": {k: _jsonable(v) for k, v in (span.attributes or {}).items()},
        "links": [{"trace_id": f"{link.context.trace_id:032x}", "span_id": f"{link.context.span_id:016x}",
                   "attributes": {k: _jsonable(v) for k, v in (link.attributes or {}).items()}}
                  for link in span.links],
    }


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per finished span to a file that several processes may share.

    Each export is a single `write` on an O_APPEND descriptor, which Linux keeps whole against
    other appenders of a local file, so lines from different processes never interleave."""

    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(json.dumps(span_record(s)) + "\n" for s in spans).encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:  # telemetry must never take the service down: say so and go on
            log.warning("cannot append spans to %s: %s", self.path, exc.strerror)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def read_span_file(path: str) -> list[dict[str, Any]]:
    """The spans a span file holds (a partly written last line is skipped)."""
    spans = []
    try:
        text = open(path, encoding="utf-8").read()
    except FileNotFoundError:
        return []
    for line in text.splitlines():
        try:
            spans.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return spans
