"""Configuration of the controller service."""

from __future__ import annotations

from pydantic import Field

from rlfleet.common.config import ServiceConfig


class ControllerConfig(ServiceConfig):
    """Controller: drives the run (task feed, budget, evaluations, promotion gate, run record) on the
    platform launched in its run directory."""

    run_dir: str = Field("", description="the run directory of the platform (platform.json, run_state.json, "
                         "the report); required")
    resume_on_start: bool = Field(True, description="continue the run the run directory's state says this "
                                  "service was driving when it stopped (a restart after a crash)")
    keep_lines: int = Field(5000, ge=100, description="progress lines kept for WatchRun (older ones are dropped)")
