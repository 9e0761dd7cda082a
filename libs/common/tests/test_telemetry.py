"""The span file exporter and the trace context carried in records."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
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
    other = tracer.start_span("linked",
                              links=[link_to({"traceparent": f"00-{parent.get_span_context().trace_id:032x}"
                                                             f"-{parent.get_span_context().span_id:016x}-01"},
                                             {"why": "test"})])
    other.end()
    child, parent_record, linked = read_span_file(str(path))
    assert (child["name"], parent_record["name"]) == ("child", "parent")
    assert (child["trace_id"] == parent_record["trace_id"]
            and child["parent_span_id"] == parent_record["span_id"])
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
    # the invalid all-zero ids
    assert link_to({"traceparent": "00-" + "0" * 32 + "-" + "0" * 16 + "-01"}) is None


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
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "spans.jsonl")],
                            capture_output=True, text=True, timeout=60)
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
"""  # noqa: E501 (the script's text)
    path = tmp_path / "spans.jsonl"
    result = subprocess.run([sys.executable, "-c", script, str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True"] and read_span_file(str(path)) == []


class _FakeChannel:
    """Records what a unary call was sent with; `fail` makes it raise as a failed RPC would."""

    def __init__(self, fail: grpc.StatusCode | None = None) -> None:
        self.sent: list[tuple] = []
        self.fail = fail

    def unary_unary(self, method, request_serializer=None, response_deserializer=None,
                    _registered_method=None):
        async def call(request, timeout=None, metadata=None):  # noqa: ASYNC109 - grpc's keyword
            self.sent.append((method, request, timeout, metadata))
            if self.fail is not None:
                raise grpc.aio.AioRpcError(self.fail, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           details="down")
            return f"reply to {request}"
        return call

    async def close(self) -> None:
        self.sent.append(("closed",))


def test_a_traced_channel_gives_each_call_a_client_span_and_sends_its_context_with_the_call():
    import asyncio

    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from rlfleet.common.grpc_server import TracedChannel

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    inner = _FakeChannel()
    stub = TracedChannel(inner, provider.get_tracer("t")).unary_unary(
        "/rlfleet.session.v1.SessionService/GetSession")

    async def go():
        with provider.get_tracer("t").start_as_current_span("episode"):
            return await stub("req", timeout=2.0, metadata=(("x-caller", "w1"),))

    assert asyncio.run(go()) == "reply to req"
    client, episode = exporter.get_finished_spans()
    assert client.name == "/rlfleet.session.v1.SessionService/GetSession" and client.parent.span_id == \
        episode.context.span_id
    assert (client.attributes["rpc.service"], client.attributes["rpc.method"]) == (
        "rlfleet.session.v1.SessionService", "GetSession")
    (_, request, timeout, metadata), = inner.sent
    sent = dict(metadata)
    assert (request, timeout, sent["x-caller"]) == ("req", 2.0, "w1")
    assert sent["traceparent"].split("-")[2] == f"{client.context.span_id:016x}"  # the server continues it

    failing = TracedChannel(_FakeChannel(grpc.StatusCode.UNAVAILABLE), provider.get_tracer("t"))
    with pytest.raises(grpc.aio.AioRpcError):
        asyncio.run(failing.unary_unary(b"/rlfleet.gateway.v1.GatewayService/Admit")("req"))
    failed = exporter.get_finished_spans()[-1]
    assert failed.status.status_code.name == "ERROR" and failed.attributes["rpc.grpc.status_code"] == 14
    asyncio.run(failing.close())  # everything but unary_unary is the wrapped channel's
    assert failing._inner.sent[-1] == ("closed",)


def test_a_negative_reward_is_kept_as_a_penalty_not_dropped_by_the_histogram(caplog):
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from rlfleet.common.telemetry import RewardHistograms

    reader = InMemoryMetricReader()
    rewards = RewardHistograms(MeterProvider(metric_readers=[reader]).get_meter("t"), "x", "rewards")
    for reward in (1.0, 0.0, -0.3, -0.1):
        rewards.record(reward, {"kind": "k"})
    points = {m.name: m.data.data_points[0] for rm in reader.get_metrics_data().resource_metrics
              for sm in rm.scope_metrics for m in sm.metrics}
    assert (points["x_reward"].count, points["x_reward"].sum) == (2, 1.0)
    assert points["x_penalty"].count == 2 and points["x_penalty"].sum == pytest.approx(0.4)
    assert "non-negative" not in caplog.text
