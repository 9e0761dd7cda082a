"""The span file exporter and the trace context carried in records."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from rlfleet.common.telemetry import JsonLinesSpanExporter, current_trace_context, link_to, read_span_file


def provider_writing_to(path) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(str(path))))
    return provider


def test_finished_spans_are_appended_as_json_lines_with_parent_and_links(tmp_path):
    path = tmp_path / "spans" / "all.jsonl"
    tracer = provider_writing_to(path).get_tracer("t")
    with tracer.start_as_current_span("parent") as parent, tracer.start_as_current_span("child"):
        pass
    other = tracer.start_span("linked", links=[link_to({"traceparent": f"00-{parent.get_span_context().trace_id:032x}"
                                                                      f"-{parent.get_span_context().span_id:016x}-01"},
                                                       {"why": "test"})])
    other.end()
    child, parent_record, linked = read_span_file(str(path))
    assert (child["name"], parent_record["name"]) == ("child", "parent")
    assert child["trace_id"] == parent_record["trace_id"] and child["parent_span_id"] == parent_record["span_id"]
    assert parent_record["parent_span_id"] is None
    assert linked["links"] == [{"trace_id": parent_record["trace_id"], "span_id": parent_record["span_id"],
                                "attributes": {"why": "test"}}]


def test_concurrent_writers_never_interleave_lines(tmp_path):
    path = tmp_path / "spans.jsonl"
    tracers = [provider_writing_to(path).get_tracer(f"t{i}") for i in range(4)]

    def write(tracer) -> None:
        for i in range(50):
            with tracer.start_as_current_span(f"s{i}", attributes={"pad": "x" * 2000}):
                pass

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(write, tracers))
    lines = path.read_text().splitlines()
    assert len(lines) == 200
    assert all(json.loads(line)["attributes"]["pad"] == "x" * 2000 for line in lines)


def test_trace_context_round_trips_through_a_record_and_bad_headers_give_no_link():
    tracer = TracerProvider().get_tracer("t")
    assert current_trace_context() == {}  # no active span: nothing to carry
    with tracer.start_as_current_span("episode") as span:
        carried = current_trace_context()
    link = link_to(carried)
    assert link is not None and link.context.trace_id == span.get_span_context().trace_id
    assert link.context.span_id == span.get_span_context().span_id
    assert link_to({}) is None
    assert link_to({"traceparent": "not a traceparent"}) is None
    assert link_to({"traceparent": "00-" + "0" * 32 + "-" + "0" * 16 + "-01"}) is None  # the invalid all-zero ids


def test_a_missing_collector_does_not_stall_shutdown(tmp_path):
    script = """
import sys, time
from opentelemetry import trace
from rlfleet.common.config import MetricsConfig, TelemetryConfig
from rlfleet.common.telemetry import setup_telemetry
state = setup_telemetry("t", TelemetryConfig(otlp_endpoint="http://127.0.0.1:9", export_timeout_s=0.5,
                                             span_file=sys.argv[1]), MetricsConfig(enabled=False))
with trace.get_tracer("t").start_as_current_span("s"):
    pass
started = time.monotonic()
state.shutdown(0.5)
print(time.monotonic() - started)
"""
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "spans.jsonl")], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout.strip().splitlines()[-1]) < 5.0
    assert time.monotonic() - started < 30
    # The span file still got the span: one exporter failing does not lose the other's output.
    assert [s["name"] for s in read_span_file(str(tmp_path / "spans.jsonl"))] == ["s"]


def test_without_an_exporter_no_span_is_recorded_and_grpc_calls_are_not_intercepted():
    script = """
from opentelemetry import trace
from rlfleet.common.config import MetricsConfig, TelemetryConfig
from rlfleet.common.grpc_server import channel
from rlfleet.common.telemetry import setup_telemetry, tracing_enabled
setup_telemetry("t", TelemetryConfig(), MetricsConfig(enabled=False))
with trace.get_tracer("t").start_as_current_span("s") as span:
    print(tracing_enabled(), span.is_recording(), len(channel("127.0.0.1:9")._unary_unary_interceptors or []))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    # No client interceptor: an intercepted call takes grpc.aio's slower path.
    assert result.stdout.split() == ["False", "False", "0"]


def test_a_sample_ratio_of_zero_records_no_trace_even_with_a_span_file(tmp_path):
    script = """
import sys
from opentelemetry import trace
from rlfleet.common.config import MetricsConfig, TelemetryConfig
from rlfleet.common.telemetry import setup_telemetry, tracing_enabled
state = setup_telemetry("t", TelemetryConfig(span_file=sys.argv[1], sample_ratio=0.0), MetricsConfig(enabled=False))
with trace.get_tracer("t").start_as_current_span("root"), trace.get_tracer("t").start_as_current_span("child"):
    pass
state.shutdown(0.5)
print(tracing_enabled())
"""
    path = tmp_path / "spans.jsonl"
    result = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True"] and read_span_file(str(path)) == []
