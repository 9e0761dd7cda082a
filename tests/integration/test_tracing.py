"""One trace per episode across the real processes, and the training step that links to it.

A rollout worker process runs calc episodes (the scripted engine stands in for the policy) through
the real session server, gateway, sandbox manager and verifier; a trainer process with a tiny model
trains on the group. Every process appends its finished spans to one file
(`telemetry.span_file`), and the test reads the trace back from there.

A second, smaller launch serves the policy from the launcher's own CPU engine, traced through
its `engine` section: the trace then reaches into the engine, whose server span for each
generate call is the child of the gateway's client span.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import aiohttp
import pytest

from rlfleet.common.processes import ChildProcess
from rlfleet.common.telemetry import read_span_file
from rlfleet.common.testing import unique_run_id
from rlfleet.envkit.submit import publish_tasks, write_for_verifier
from rlfleet.envkit.suites import calc
from rlfleet.envkit.testing import LaunchedPlatform, build_tokenizer, start_scripted_engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy"))
import deploy_helpers as h  # the metrics catalogue's reader

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BIN = Path(sys.executable).parent
SERVICES = ("sandbox-manager", "rollout-gateway", "session-server", "verifier", "trainer")
ROLLOUT_SERVICES = ("sandbox-manager", "rollout-gateway", "session-server", "verifier")
# The sections of the launch config that configure them.
SECTIONS = ("sandbox", "gateway", "session", "verifier", "trainer")
ROLLOUT_SECTIONS = ("sandbox", "gateway", "session", "verifier")
GROUP_SIZE = 2


def start_worker(info, spans: Path, root: Path) -> tuple[ChildProcess, int]:
    """A rollout worker writing spans to `spans`; (its process, its metrics port)."""
    ready = root / "worker.ready.json"
    worker = ChildProcess([str(BIN / "rlfleet-worker"), "--run-id", info.run_id, "--nats.url", info.nats_url,
                           "--nats.user", "worker",
                           "--nats.password-file", info.nats_login("worker")["password_file"],
                           "--session-address", info.session_address,
                           "--sandbox-address", info.sandbox_address,
                           "--verifier-address", info.verifier_address, "--log.format", "text",
                           "--telemetry.span-file", str(spans), "--ready-file", str(ready)],
                          root / "worker.log", name="worker").spawn()
    return worker, worker.wait_for_file(ready, 60)["metrics_port"]


def submit_one_task(info, seed: int, group_size: int):
    """One calc training task, known to the verifier and published on TASKS as a group."""
    task = calc.generate_tasks("train", 1, seed=seed)[0]
    write_for_verifier([task], info.suites_dir)
    asyncio.run(publish_tasks([task], info.run_id, info.nats_url, group_size=group_size, epoch=seed,
                              login=info.nats_login("operator")))
    return task


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """A platform whose every process writes spans to one file, after one group was rolled out and trained."""
    from rlfleet.trainer.testing import write_tiny_model

    root = tmp_path_factory.mktemp("tracing")
    spans = root / "spans.jsonl"
    tokenizer_dir = build_tokenizer(root / "tokenizer")
    policy = write_tiny_model(root / "policy", vocab_size=512)
    engine, url = start_scripted_engine(tokenizer_dir, root)
    traced_everywhere = {name: {"telemetry.span_file": str(spans)} for name in SECTIONS}
    traced_everywhere["trainer"].update({
        "model_path": str(policy), "group_size": GROUP_SIZE, "groups_per_step": 1,
        # The scripted policy always passes: a group of equal rewards must still be trained here.
        "group_filter.drop_all_equal_rewards": False, "group_filter.min_samples": 1,
        "weights.served_dtype": "fp32"})
    platform = LaunchedPlatform(root / "run", unique_run_id("trace"), tokenizer_dir, engine_url=url,
                                services=SERVICES, sections=traced_everywhere)
    worker = None
    try:
        platform.up()
        info = platform.info
        worker, worker_metrics_port = start_worker(info, spans, root)
        task = submit_one_task(info, seed=808, group_size=GROUP_SIZE)
        step = wait_for_span(spans, lambda s: s["name"] == "trainer step", timeout_s=120)
        yield {"spans": spans, "step": step, "platform": platform, "worker_metrics_port": worker_metrics_port,
               "task_id": task.task_id}
    finally:
        if worker is not None:
            worker.stop()
        platform.down()
        engine.stop()


@pytest.fixture(scope="module")
def engine_traced(tmp_path_factory):
    """A launch whose CPU engine (started by the launcher, not the scripted one) writes spans too,
    after one episode was rolled out on it."""
    from rlfleet.engine.testing import build_tiny_model

    root = tmp_path_factory.mktemp("engine-tracing")
    spans = root / "spans.jsonl"
    model = build_tiny_model(root / "model")
    # The engines take their section like a service does: telemetry.span_file in their config file.
    traced_everywhere = {name: {"telemetry.span_file": str(spans)} for name in (*ROLLOUT_SECTIONS, "engine")}
    platform = LaunchedPlatform(root / "run", unique_run_id("trace-engine"), model, engines=1,
                                services=ROLLOUT_SERVICES, sections=traced_everywhere)
    worker = None
    try:
        platform.up()
        info = platform.info
        worker, _ = start_worker(info, spans, root)
        task = submit_one_task(info, seed=809, group_size=1)
        episode = wait_for_span(spans, lambda s: s["name"] == "episode"
                                and s["attributes"].get("rlfleet.task_id") == task.task_id, timeout_s=120)

        def served_every_call(span_list: list[dict]) -> bool:
            trace = [s for s in span_list if s["trace_id"] == episode["trace_id"]]
            calls = {s["span_id"] for s in trace if s["name"] == "engine POST /generate"}
            return bool(calls) and calls <= {s["parent_span_id"] for s in trace}

        # The engine exports on its own schedule: wait until each engine call's server span is there.
        wait_until(lambda: served_every_call(read_span_file(str(spans))), timeout_s=15)
        state = json.loads((Path(platform.run_dir) / "platform.json").read_text())
        engine_pid = next(p["pid"] for p in state["processes"] if p["name"] == "engine-0")
        yield {"spans": spans, "episode": episode, "engine_pid": engine_pid}
    finally:
        if worker is not None:
            worker.stop()
        platform.down()


def wait_until(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout_s} s")
        time.sleep(0.2)


def wait_for_span(path: Path, want, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [s for s in read_span_file(str(path)) if want(s)]
        if found:
            return found[0]
        time.sleep(0.5)
    names = sorted({(s["service"], s["name"]) for s in read_span_file(str(path))})
    raise AssertionError(f"no such span after {timeout_s} s; spans so far: {names}")


def by_trace(spans: list[dict]) -> dict[str, list[dict]]:
    traces = defaultdict(list)
    for span in spans:
        traces[span["trace_id"]].append(span)
    return traces


def test_an_episode_is_one_trace_across_the_worker_and_every_service_it_calls(traced):
    spans = read_span_file(str(traced["spans"]))
    roots = [s for s in spans
             if s["name"] == "episode" and s["attributes"]["rlfleet.task_id"] == traced["task_id"]]
    assert len(roots) == GROUP_SIZE
    assert len({r["trace_id"] for r in roots}) == GROUP_SIZE, "each episode is a trace of its own"
    for root in roots:
        assert root["parent_span_id"] is None and root["service"] == "rlfleet-worker"
        trace = by_trace(spans)[root["trace_id"]]
        by_id = {s["span_id"]: s for s in trace}
        # Every span of the trace hangs off the episode's root (no orphan, no second root).
        for span in trace:
            if span is not root:
                assert span["parent_span_id"] in by_id, f"{span['service']} {span['name']} has no parent here"
        services = {s["service"] for s in trace}
        assert {"rlfleet-worker", "rlfleet-session-server", "rlfleet-gateway", "rlfleet-sandbox-manager",
                "rlfleet-verifier"} <= services
        assert len({s["pid"] for s in trace}) >= 5, "spans from the worker and four service processes"

        def server(method: str, trace: list[dict] = trace) -> list[dict]:
            return [s for s in trace if s["kind"] == "SERVER" and s["name"].endswith(method)]

        # Across each gRPC hop the server span is the child of the caller's client span, in another process.
        for method in ("SessionService/OpenSession", "SessionService/Generate", "SandboxService/Exec",
                       "VerifierService/Verify", "GatewayService/Generate", "SessionService/CloseSession"):
            assert server(method), f"no server span for {method}"
            for span in server(method):
                parent = by_id[span["parent_span_id"]]
                assert parent["kind"] == "CLIENT" and parent["name"].endswith(method)
                assert parent["pid"] != span["pid"]
        # session Generate (or the OpenSession the first turn comes with) -> gateway Generate -> the
        # engine call, one chain
        callers = []
        for gateway in server("GatewayService/Generate"):
            caller = by_id[by_id[gateway["parent_span_id"]]["parent_span_id"]]
            callers.append(caller["name"].rpartition("/")[2])
            assert caller["service"] == "rlfleet-session-server"
            engine_calls = [s for s in trace if s["name"] == "engine POST /generate"
                            and by_id[s["parent_span_id"]]["service"] == "rlfleet-gateway"]
            assert engine_calls
        assert callers.count("OpenSession") == 1 and set(callers) == {"OpenSession", "Generate"}, callers
        # The tool call: the SDK's tool span is the ancestor of the sandbox's Exec server span.
        [tool] = [s for s in trace if s["name"] == "tool"]
        exec_span = server("SandboxService/Exec")[0]
        assert by_id[exec_span["parent_span_id"]]["parent_span_id"] == tool["span_id"]
        # And the publication, inside the CloseSession call.
        [publish] = [s for s in trace if s["name"] == "TRAJECTORIES publish"]
        assert by_id[publish["parent_span_id"]]["name"].endswith("SessionService/CloseSession")
        assert publish["attributes"]["rlfleet.trajectory_id"] == root["attributes"]["rlfleet.trajectory_id"]


def test_the_training_step_links_to_the_trace_of_every_episode_it_trained_on(traced):
    spans = read_span_file(str(traced["spans"]))
    step = traced["step"]
    assert step["service"] == "rlfleet-trainer" and step["attributes"]["rlfleet.samples"] == GROUP_SIZE
    roots = {s["attributes"]["rlfleet.trajectory_id"]: s for s in spans
             if s["name"] == "episode" and s["attributes"]["rlfleet.task_id"] == traced["task_id"]}
    links = {link["attributes"]["rlfleet.trajectory_id"]: link for link in step["links"]}
    assert links.keys() == roots.keys()
    for trajectory_id, link in links.items():
        assert link["trace_id"] == roots[trajectory_id]["trace_id"]
        # The link names a span of that trace: the close that sealed the trajectory.
        linked = [s for s in spans if s["span_id"] == link["span_id"]]
        assert linked and linked[0]["trace_id"] == link["trace_id"]
        assert linked[0]["name"].endswith("SessionService/CloseSession") and linked[0]["kind"] == "SERVER"
    assert step["trace_id"] not in {r["trace_id"] for r in roots.values()}, "a step is its own trace"


async def scrape(port: int) -> str:
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as reply:
        assert reply.status == 200
        return await reply.text()


def exported_types(text: str) -> dict[str, str]:
    """Exported sample names -> Prometheus type, from the `# TYPE` lines."""
    types = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name.removesuffix("_total") if kind == "counter" else name] = kind
    return types


async def test_the_vital_signs_the_loop_produced_are_exported_under_their_catalogue_names(traced):
    """What the registration test cannot see: the live exporter's names and types on real processes."""
    state = json.loads((Path(traced["platform"].run_dir) / "platform.json").read_text())
    ports = {p["name"]: p["metrics_port"] for p in state["processes"] if p.get("metrics_port")}
    ports["worker"] = traced["worker_metrics_port"]
    exported = {}
    for name, port in ports.items():
        exported[name] = exported_types(await scrape(port))
    entries = h.metrics_catalogue()
    # The metrics this run certainly recorded, by process.
    seen = {"session-server": ["rlfleet_session_generate_seconds", "rlfleet_session_trajectory_tokens",
                               "rlfleet_session_trajectories_published_total"],
            "rollout-gateway": ["rlfleet_gateway_generate_seconds", "rlfleet_gateway_engine_policy_version",
                                "rlfleet_gateway_engine_busy_seconds_total",
                                "rlfleet_gateway_engine_in_flight_requests"],
            "sandbox-manager": ["rlfleet_sandbox_exec_latency_seconds"],
            "verifier": ["rlfleet_verifier_reward"],
            "trainer": ["rlfleet_trainer_staleness_versions", "rlfleet_trainer_idle_ratio",
                        "rlfleet_trainer_steps_total", "rlfleet_queue_pending_messages"],
            "worker": ["rlfleet_worker_tool_wait_seconds", "rlfleet_worker_episode_duration_seconds",
                       "rlfleet_queue_pending_messages", "rlfleet_queue_ack_pending_messages"]}
    for process, names in seen.items():
        for name in names:
            entry = entries[name]
            key = name.removesuffix("_total") if entry.type == "counter" else name
            assert exported[process].get(key) == entry.type, \
                f"{process} does not export {name} as {entry.type}"


def test_the_engine_serves_each_generate_call_as_a_child_span_in_the_episodes_trace(engine_traced):
    spans = read_span_file(str(engine_traced["spans"]))
    episode = engine_traced["episode"]
    trace = by_trace(spans)[episode["trace_id"]]
    by_id = {s["span_id"]: s for s in trace}
    calls = [s for s in trace if s["name"] == "engine POST /generate"]
    served = [s for s in trace if s["service"] == "rlfleet-cpu-engine"]
    assert calls and len(served) == len(calls), "one engine span per engine call"
    for span in served:
        assert span["name"] == "POST /generate" and span["kind"] == "SERVER"
        assert span["pid"] == engine_traced["engine_pid"], "recorded by the launcher's engine process"
        # The child of the gateway's client span, across the process boundary, in the episode's trace.
        client = by_id[span["parent_span_id"]]
        assert client["name"] == "engine POST /generate" and client["kind"] == "CLIENT"
        assert client["service"] == "rlfleet-gateway" and client["pid"] != span["pid"]
        assert by_id[client["parent_span_id"]]["name"].endswith("GatewayService/Generate")
        assert (client["start_unix_ns"] <= span["start_unix_ns"] <= span["end_unix_ns"]
                <= client["end_unix_ns"])
        # What the engine says about the call agrees with what the gateway saw.
        served_attrs, client_attrs = span["attributes"], client["attributes"]
        assert served_attrs["rlfleet.input_tokens"] == client_attrs["rlfleet.input_tokens"] > 0
        assert served_attrs["rlfleet.output_tokens"] == client_attrs["rlfleet.output_tokens"] > 0
        assert served_attrs["rlfleet.weight_version"] == client_attrs["rlfleet.weight_version"] == "0"
        assert served_attrs["rlfleet.finish_reason"] in ("stop", "length")
        assert served_attrs["rlfleet.queue_wait_s"] >= 0 and served_attrs["rlfleet.engine_id"] == "engine-0"
        assert served_attrs["http.response.status_code"] == 200 and span["status"] == "UNSET"
    # Still one trace: every span hangs off the episode's root.
    for span in trace:
        if span["span_id"] != episode["span_id"]:
            assert span["parent_span_id"] in by_id, f"{span['service']} {span['name']} has no parent here"
