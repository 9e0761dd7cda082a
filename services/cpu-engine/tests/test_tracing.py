"""The engine as a traced server: a request's `traceparent` makes its SERVER span a child of the
caller's span, described from the reply, over the request's whole life in the batcher."""

from __future__ import annotations

import json
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from rlfleet.common.telemetry import read_span_file
from rlfleet.engine.config import EngineConfig
from rlfleet.engine.main import config_from_args
from rlfleet.engine.protocol import GenerateItem, SamplingSpec
from rlfleet.engine.scheduler import Request, Scheduler
from rlfleet.engine.server import EngineServer
from rlfleet.engine.testing import EngineProcess, http_call

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
CALLER_SPAN_ID = 0x00F067AA0BA902B7
TRACEPARENT = f"00-{TRACE_ID:032x}-{CALLER_SPAN_ID:016x}-01"


@pytest.fixture
async def traced(runner, model_dir, tmp_path):
    """An engine server in this process whose spans go to memory, and a client for it."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "rlfleet-cpu-engine"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    scheduler = Scheduler(runner, weight_version="7")
    server = EngineServer(
        EngineConfig(model_path=model_dir, engine_id="e-test", weight_store_root=tmp_path), runner, scheduler,
        provider.get_tracer("test")
    )
    scheduler.start()
    client = TestClient(TestServer(server.app()))
    await client.start_server()
    try:
        yield client, exporter
    finally:
        await client.close()
        scheduler.stop()
        provider.shutdown()


def only(exporter: InMemorySpanExporter, name: str):
    spans = [s for s in exporter.get_finished_spans() if s.name == name]
    assert len(spans) == 1, [s.name for s in exporter.get_finished_spans()]
    return spans[0]


async def test_a_generate_span_is_the_child_of_the_callers_span_and_describes_the_reply(traced):
    client, exporter = traced
    body = {
        "input_ids": [1, 5, 6, 7],
        "sampling_params": {"max_new_tokens": 6, "sampling_seed": 3},
        "rid": "r-1",
    }
    reply = await client.post("/generate", json=body, headers={"traceparent": TRACEPARENT})
    assert reply.status == 200
    meta = (await reply.json())["meta_info"]

    span = only(exporter, "POST /generate")
    assert span.kind is SpanKind.SERVER
    assert span.context.trace_id == TRACE_ID
    assert span.parent is not None and span.parent.span_id == CALLER_SPAN_ID and span.parent.is_remote
    attributes = span.attributes
    assert attributes["rlfleet.input_tokens"] == 4 == meta["prompt_tokens"]
    assert attributes["rlfleet.output_tokens"] == meta["completion_tokens"] > 0
    assert attributes["rlfleet.finish_reason"] == meta["finish_reason"]["type"]
    assert attributes["rlfleet.weight_version"] == "7" and tuple(attributes["rlfleet.weight_versions"]) == (
        "7",
    )
    assert attributes["rlfleet.rid"] == "r-1" and attributes["rlfleet.engine_id"] == "e-test"
    assert attributes["http.response.status_code"] == 200 and span.status.status_code is StatusCode.UNSET
    assert 0 <= attributes["rlfleet.queue_wait_s"] <= meta["e2e_latency"]
    # The span covers the request's life in the engine: queued, prefilled, decoded, finished.
    assert (span.end_time - span.start_time) / 1e9 >= meta["e2e_latency"]


async def test_a_batch_is_one_span_and_an_untraced_caller_starts_a_trace_of_its_own(traced):
    client, exporter = traced
    body = {"input_ids": [[1, 5, 6, 7], [1, 9]], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    reply = await client.post("/generate", json=body)
    assert reply.status == 200
    span = only(exporter, "POST /generate")
    assert span.parent is None
    attributes = span.attributes
    assert attributes["rlfleet.requests"] == 2 and attributes["rlfleet.input_tokens"] == 6
    assert attributes["rlfleet.output_tokens"] == 6 and attributes["rlfleet.finish_reason"] == "length"
    assert "rlfleet.rid" not in attributes


async def test_bad_requests_are_recorded_as_the_callers_error_and_polls_are_not_traced(traced):
    client, exporter = traced
    reply = await client.post("/generate", json={"input_ids": []}, headers={"traceparent": TRACEPARENT})
    assert reply.status == 400
    span = only(exporter, "POST /generate")
    assert span.attributes["http.response.status_code"] == 400
    assert span.status.status_code is StatusCode.UNSET  # a 4xx is not the server's failure
    for path in ("/health", "/v1/loads", "/model_info", "/server_info"):
        assert (await client.get(path, headers={"traceparent": TRACEPARENT})).status == 200
    assert [s.name for s in exporter.get_finished_spans()] == ["POST /generate"]


async def test_weight_updates_have_spans_of_their_own(traced, tmp_path):
    client, exporter = traced
    reply = await client.post(
        "/update_weight_version", json={"new_version": "8"}, headers={"traceparent": TRACEPARENT}
    )
    assert reply.status == 200
    version = only(exporter, "POST /update_weight_version")
    assert version.kind is SpanKind.SERVER and version.parent.span_id == CALLER_SPAN_ID
    assert version.attributes["rlfleet.weight_version"] == "8"

    missing = str(tmp_path / "missing")
    reply = await client.post("/update_weights_from_disk", json={"model_path": missing})
    assert reply.status == 400
    failed = only(exporter, "POST /update_weights_from_disk")
    assert failed.attributes["rlfleet.success"] is False
    assert failed.status.status_code is StatusCode.ERROR and missing in failed.status.description


def test_the_queue_wait_is_the_time_before_the_batch_first_picked_the_request_up(runner):
    scheduler = Scheduler(runner, max_running_requests=1)
    outputs = {}
    for rid in ("first", "second"):
        item = GenerateItem(rid, [1, 5, 6], SamplingSpec(max_new_tokens=4, ignore_eos=True))
        scheduler.submit(Request(item, runner.eos_token_ids, lambda out: outputs.__setitem__(out.rid, out)))
    while len(outputs) < 2:
        scheduler.step()
    first, second = outputs["first"], outputs["second"]
    # One batch slot: the second waited in the queue while the first was decoded.
    assert 0 <= first.queue_wait_s < second.queue_wait_s <= second.e2e_latency


def test_telemetry_flags_are_those_of_the_other_services():
    config = config_from_args(
        [
            "--model-path",
            "/m",
            "--telemetry.span-file",
            "/tmp/spans.jsonl",
            "--set",
            "metrics.enabled=false",
            "--set",
            "telemetry.otlp_endpoint=http://otel:4317",
            "--weight-version",
            "0",
        ]
    )
    assert config.telemetry.span_file == "/tmp/spans.jsonl" and not config.metrics.enabled
    assert config.telemetry.otlp_endpoint == "http://otel:4317" and config.weight_version == "0"
    # An explicit flag wins over --set, as for the services.
    assert config_from_args(["--model-path", "/m", "--set", "port=7", "--port", "8"]).port == 8


@pytest.mark.integration
async def test_the_engine_process_writes_its_spans_and_stops_fast_without_a_collector(model_dir, tmp_path):
    spans = tmp_path / "spans.jsonl"
    engine = EngineProcess(
        model_dir,
        tmp_path,
        engine_id="e-spans",
        **{"telemetry.span_file": spans, "telemetry.otlp_endpoint": "http://127.0.0.1:9"},
    ).start()
    try:
        ready = json.loads(next(tmp_path.glob("engine-*.ready.json")).read_text())
        assert ready["metrics_port"] > 0
        body = {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 2}}
        status, _ = await http_call(engine.url, "/generate", body, within_s=30)
        assert status == 200
    finally:
        started = time.monotonic()
        engine.stop()
        stopped_s = time.monotonic() - started
    assert engine.process.returncode == 0
    assert stopped_s < 5, f"took {stopped_s:.1f}s to stop with no collector listening"
    [span] = [s for s in read_span_file(str(spans)) if s["name"] == "POST /generate"]
    assert span["service"] == "rlfleet-cpu-engine" and span["pid"] == ready["pid"]
    assert span["attributes"]["rlfleet.input_tokens"] == 3
