"""The controller's metrics (served for Prometheus by the shared telemetry setup)."""

from __future__ import annotations

from rlfleet.common.telemetry import meter


class ControllerMetrics:
    """rlfleet_controller_runs_total{how} (how: started | resumed), rlfleet_controller_run_ends_total{status},
    rlfleet_controller_progress_lines_total."""

    def __init__(self) -> None:
        m = meter("rlfleet.controller")
        self.runs = m.create_counter("rlfleet_controller_runs_total", description="runs driven, by how they began")
        self.ends = m.create_counter("rlfleet_controller_run_ends_total", description="runs ended, by status")
        self.lines = m.create_counter("rlfleet_controller_progress_lines_total", description="progress lines said")
