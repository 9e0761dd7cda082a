"""The controller's metrics (served for Prometheus by the shared telemetry setup)."""

from __future__ import annotations

from rlfleet.common.telemetry import meter


class ControllerMetrics:
    """rlfleet_controller_runs_total{how} (how: started | resumed | configured),
    rlfleet_controller_run_ends_total{status}, rlfleet_controller_progress_lines_total,
    rlfleet_controller_state_saves_total{outcome} (ok | unavailable | lost: taken over by another
    controller), rlfleet_controller_state_bytes (the stored state's compressed size, per save)."""

    def __init__(self) -> None:
        m = meter("rlfleet.controller")
        self.runs = m.create_counter("rlfleet_controller_runs_total",
                                     description="runs driven, by how they began")
        self.ends = m.create_counter("rlfleet_controller_run_ends_total", description="runs ended, by status")
        self.lines = m.create_counter("rlfleet_controller_progress_lines_total",
                                      description="progress lines said")
        self.state_saves = m.create_counter("rlfleet_controller_state_saves_total",
                                            description="saves of the run's state (JetStream KV), by outcome")
        self.state_bytes = m.create_histogram("rlfleet_controller_state_bytes",
                                              description="compressed size of the run's state at each save")
