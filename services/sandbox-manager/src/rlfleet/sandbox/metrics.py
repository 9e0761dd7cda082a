"""The sandbox manager's metrics (served for Prometheus by the shared telemetry setup)."""

from __future__ import annotations

from collections.abc import Callable

from opentelemetry.metrics import CallbackOptions, Observation

from rlfleet.common.telemetry import meter, seconds_histogram
from rlfleet.sandbox.driver import ExecResult


class SandboxMetrics:
    """rlfleet_sandbox_creates_total{from_warm_pool}, rlfleet_sandbox_exec_latency_seconds,
    rlfleet_sandbox_violations_total{kind}, rlfleet_sandbox_warm_pool_size,
    rlfleet_sandbox_active_sandboxes, rlfleet_sandbox_stale_leases_removed_total,
    rlfleet_sandbox_creates_refused_total{cap}."""

    def __init__(self, active: Callable[[], int], pool_size: Callable[[], int]) -> None:
        m = meter("rlfleet.sandbox")
        self.creates = m.create_counter("rlfleet_sandbox_creates_total", description="sandboxes created")
        self.exec_latency = seconds_histogram(m, "rlfleet_sandbox_exec_latency_seconds",
                                              "wall time of one exec, sandbox setup included")
        self.violations = m.create_counter("rlfleet_sandbox_violations_total",
                                           description="limit and policy violations recorded, by kind")
        self.stale_leases = m.create_counter("rlfleet_sandbox_stale_leases_removed_total",
                                             description="leases of dead managers removed at start-up")
        self.refusals = m.create_counter("rlfleet_sandbox_creates_refused_total",
                                         description="creates refused at a cap on open sandboxes, by cap")
        m.create_observable_gauge("rlfleet_sandbox_active_sandboxes", callbacks=[_gauge(active)],
                                  description="live sandboxes held by this manager")
        m.create_observable_gauge("rlfleet_sandbox_warm_pool_size", callbacks=[_gauge(pool_size)],
                                  description="ready sandboxes in the warm pool")

    def created(self, from_warm_pool: bool) -> None:
        self.creates.add(1, {"from_warm_pool": str(from_warm_pool).lower()})

    def refused(self, cap: str) -> None:
        self.refusals.add(1, {"cap": cap})

    def executed(self, result: ExecResult, seconds: float) -> None:
        self.exec_latency.record(seconds)
        for violation in result.violations:
            self.violations.add(1, {"kind": violation.kind.value.lower()})


def _gauge(read: Callable[[], int]):
    def callback(_options: CallbackOptions) -> list[Observation]:
        return [Observation(read())]
    return callback
