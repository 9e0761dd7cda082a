"""Configuration of the controller service."""

from __future__ import annotations

from pydantic import Field

from rlfleet.common.config import NatsConfig, ServiceConfig


class ControllerConfig(ServiceConfig):
    """Controller: drives the run (task feed, budget, evaluations, promotion gate, run record) on the
    platform whose services it is given."""

    run_dir: str = Field("", description="the run's directory (run_state.json, the suites it hands the verifier, "
                         "the report); required")
    nats: NatsConfig = Field(default_factory=NatsConfig,
                             description="the run's NATS, as the controller (hands out tasks, follows trajectories "
                             "and versions; its rollout worker takes the tasks)")
    gateway_address: str = Field("", description="host:port of the rollout gateway (admission policy)")
    trainer_address: str = Field("", description="host:port of the trainer (status, checkpoints)")
    broker_address: str = Field("", description="host:port of the weight broker (versions served, promotion)")
    verifier_address: str = Field("", description="host:port of the verifier (scores, audits)")
    session_address: str = Field("", description="host:port of the session server (episodes)")
    sandbox_address: str = Field("", description="host:port of the sandbox manager (episodes' tools)")
    trainer_metrics_url: str = Field("", description="the trainer's Prometheus page (its data-wait counter); "
                                     "empty: the trainer's idle time is not measured")
    resume_on_start: bool = Field(True, description="continue the run the run directory's state says this "
                                  "service was driving when it stopped (a restart after a crash)")
    start_run: str = Field("", description="a run config (TOML, `rlfleet run`'s format) started when the "
                           "controller starts and has no run to resume: how a compose or Kubernetes stack trains "
                           "and gates with nobody calling StartRun")
    keep_lines: int = Field(5000, ge=100, description="progress lines kept for WatchRun (older ones are dropped)")
