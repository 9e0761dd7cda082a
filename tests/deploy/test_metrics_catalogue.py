"""docs/metrics.md names exactly what the services export, with the same type.

Each service's metrics class is built against a real OpenTelemetry meter with the Prometheus
exporter, every instrument it creates is given one value as it is created, and the exporter's own
output (names after its suffix rules, `# TYPE`) is compared with the catalogue. A metric added,
renamed or retyped in code without the catalogue (or the other way round) fails here.
"""

from __future__ import annotations

import importlib

import deploy_helpers as h
import pytest
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import REGISTRY, generate_latest


class ExercisingMeter:
    """A real meter whose synchronous instruments get one value when created (an instrument without
    data is not exported); observable ones report through the service's own callbacks."""

    # The synchronous instruments, and how each takes one value.
    FIRST_VALUE = {"create_counter": "add", "create_up_down_counter": "add", "create_histogram": "record",
                   "create_gauge": "set"}

    def __init__(self, real) -> None:
        self.real = real

    def __getattr__(self, name):  # create_observable_*: as they are
        create = getattr(self.real, name)
        if name not in self.FIRST_VALUE:
            return create

        def create_with_a_value(*args, **kwargs):
            instrument = create(*args, **kwargs)
            getattr(instrument, self.FIRST_VALUE[name])(1)
            return instrument

        return create_with_a_value


def build_gateway():
    from rlfleet.gateway.metrics import GatewayMetrics
    from rlfleet.gateway.registry import EngineRecord

    engine = EngineRecord("e0", "http://127.0.0.1:1", healthy=True, policy_version=3)
    return GatewayMetrics(lambda: [engine], lambda engine_id: 1.5, lambda engine_id: 2)


def build_sandbox():
    from rlfleet.sandbox.metrics import SandboxMetrics

    return SandboxMetrics(active=lambda: 1, pool_size=lambda: 2)


def build_queue():
    from rlfleet.common import queue_metrics

    queue_metrics._registered = False
    queue_metrics._depths[("TASKS", "rollout-workers-x")] = (4, 1)
    queue_metrics.register_queue_gauges()


# service (as the catalogue names it) -> (module whose `meter` it uses, builder)
SERVICES = {
    "worker": ("rlfleet.envkit.worker_metrics", lambda: importlib.import_module(
        "rlfleet.envkit.worker_metrics").WorkerMetrics()),
    "session-server": ("rlfleet.session.metrics", lambda: importlib.import_module(
        "rlfleet.session.metrics").SessionMetrics()),
    "rollout-gateway": ("rlfleet.gateway.metrics", build_gateway),
    "sandbox-manager": ("rlfleet.sandbox.metrics", build_sandbox),
    "verifier": ("rlfleet.verifier.metrics", lambda: importlib.import_module(
        "rlfleet.verifier.metrics").VerifierMetrics()),
    "trainer": ("rlfleet.trainer.metrics", lambda: importlib.import_module(
        "rlfleet.trainer.metrics").TrainerMetrics()),
    "weight-broker": ("rlfleet.broker.metrics", lambda: importlib.import_module(
        "rlfleet.broker.metrics").BrokerMetrics()),
    # The queue gauges are shared code, polled by the worker (TASKS) and the trainer (TRAJECTORIES).
    "worker, trainer": ("rlfleet.common.queue_metrics", build_queue),
}


def exported(text: str) -> dict[str, str]:
    """rlfleet_* metric names -> type, as the exporter wrote them (counters with their _total)."""
    types = {}
    for line in text.splitlines():
        if line.startswith("# TYPE rlfleet_"):
            _, _, name, kind = line.split(" ", 3)
            if kind == "counter" and not name.endswith("_total"):
                name += "_total"
            types[name] = kind
    return types


@pytest.fixture(scope="module")
def exports() -> dict[str, dict[str, str]]:
    """For each service, what its metrics class exports."""
    result = {}
    for service, (module_name, build) in SERVICES.items():
        module = importlib.import_module(module_name)
        reader = PrometheusMetricReader()
        provider = MeterProvider(metric_readers=[reader])
        original = module.meter
        module.meter = lambda name, p=provider: ExercisingMeter(p.get_meter(name))
        try:
            build()
            result[service] = exported(generate_latest(REGISTRY).decode())
        finally:
            module.meter = original
            provider.shutdown()  # also unregisters the reader from the global registry
    from rlfleet.common import queue_metrics

    queue_metrics._registered = False
    queue_metrics._depths.clear()
    return result


def test_the_catalogue_lists_every_exported_metric_and_nothing_else(exports):
    catalogue = h.metrics_catalogue()
    everything = {name: kind for names in exports.values() for name, kind in names.items()}
    missing = sorted(set(everything) - set(catalogue))
    assert not missing, f"exported but not in docs/metrics.md: {missing}"
    stale = sorted(set(catalogue) - set(everything))
    assert not stale, f"in docs/metrics.md but exported by no service: {stale}"


def test_each_catalogued_metric_has_the_type_and_service_it_is_exported_with(exports):
    for name, entry in h.metrics_catalogue().items():
        owners = [service for service, names in exports.items() if name in names]
        assert owners == [entry.service], f"{name}: catalogued for {entry.service!r}, exported by {owners}"
        assert exports[entry.service][name] == entry.type, f"{name}: catalogued as {entry.type}"


def test_the_loops_vital_signs_are_catalogued():
    """The issue's list of vital signs, each with a metric of the kind that can show it."""
    catalogue = h.metrics_catalogue()
    vitals = {
        "rollout latency percentiles": ("rlfleet_worker_episode_duration_seconds", "histogram"),
        "tool-wait time": ("rlfleet_worker_tool_wait_seconds", "histogram"),
        "trajectory length": ("rlfleet_session_trajectory_tokens", "histogram"),
        "engine utilisation": ("rlfleet_gateway_engine_busy_seconds_total", "counter"),
        "policy version per engine": ("rlfleet_gateway_engine_policy_version", "gauge"),
        "sample staleness": ("rlfleet_trainer_staleness_versions", "histogram"),
        "reward distribution": ("rlfleet_verifier_reward", "histogram"),
        "weight-update pause": ("rlfleet_broker_pause_seconds", "histogram"),
        "queue depths": ("rlfleet_queue_pending_messages", "gauge"),
        "trainer idle fraction": ("rlfleet_trainer_idle_ratio", "gauge"),
    }
    for vital, (name, kind) in vitals.items():
        assert name in catalogue and catalogue[name].type == kind, vital
    assert {"engine_id", "pool"} <= set(catalogue["rlfleet_gateway_engine_policy_version"].labels)
    assert {"stream", "consumer"} <= set(catalogue["rlfleet_queue_pending_messages"].labels)


def test_observed_gauges_report_what_their_callbacks_read(exports):
    """The per-engine and queue gauges carry their labels and values (not only their names)."""
    text_by_service = {}
    for service in ("rollout-gateway", "worker, trainer"):
        module_name, build = SERVICES[service]
        module = importlib.import_module(module_name)
        reader = PrometheusMetricReader()
        provider = MeterProvider(metric_readers=[reader])
        original = module.meter
        module.meter = lambda name, p=provider: ExercisingMeter(p.get_meter(name))
        try:
            build()
            text_by_service[service] = generate_latest(REGISTRY).decode()
        finally:
            module.meter = original
            provider.shutdown()
    gateway = text_by_service["rollout-gateway"]
    assert 'rlfleet_gateway_engine_policy_version{engine_id="e0"' in gateway
    assert any(line.startswith("rlfleet_gateway_engine_policy_version{") and 'pool="fleet"' in line
               and line.endswith(" 3.0") for line in gateway.splitlines())
    assert any(line.startswith("rlfleet_gateway_engine_busy_seconds_total{") and line.endswith(" 1.5")
               for line in gateway.splitlines())
    assert any(line.startswith("rlfleet_gateway_engine_in_flight_requests{") and line.endswith(" 2.0")
               for line in gateway.splitlines())
    queue = text_by_service["worker, trainer"]
    assert any(line.startswith("rlfleet_queue_pending_messages{") and 'stream="TASKS"' in line
               and line.endswith(" 4.0") for line in queue.splitlines())
    from rlfleet.common import queue_metrics

    queue_metrics._registered = False
    queue_metrics._depths.clear()
