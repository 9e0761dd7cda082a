"""Configuration of the controller service."""

from __future__ import annotations

from pydantic import Field

from rlfleet.common.config import NatsConfig, ServiceConfig, StrictModel


class RunStoreConfig(StrictModel):
    """Where the controller keeps the run's state: JetStream KV (rlfleet.controller.state_store)."""

    replicas: int = Field(1, ge=1, le=5, description="JetStream replicas of the run-state bucket when "
                          "this controller creates it (3 on a 3-node NATS cluster); a bucket that exists "
                          "keeps its own")
    lease_s: float = Field(15.0, ge=3.0, description="how long a controller's hold on a run lasts "
                           "unrenewed (it renews every third of it): a controller on another machine, or in "
                           "another container, takes a crashed holder's run over only once its lease lapsed; "
                           "one in the same PID namespace as soon as the holder's process is gone")
    part_bytes: int = Field(512 * 1024, ge=4096, le=1 << 20, description="the state is stored compressed, in "
                            "parts of at most this many bytes (NATS's default message limit is 1 MB)")
    save_timeout_s: float = Field(30.0, gt=0, description="a save is tried again this long while NATS does "
                                  "not answer (a restart) before it fails")
    mirror: bool = Field(True, description="also write each saved state to run_dir/run_state.json: "
                         "what `rlfleet run` reads before its platform is up and `rlfleet status` shows "
                         "stop rules from")


class ControllerConfig(ServiceConfig):
    """Controller: drives the run (task feed, budget, evaluations, promotion gate, run record) on the
    platform whose services it is given."""

    run_dir: str = Field("", description="this controller's run directory (the suites it hands the verifier, "
                         "the report, a copy of the run's state); required. The run's state itself is in "
                         "NATS (`state`), so a controller with another run directory continues the run")
    nats: NatsConfig = Field(default_factory=NatsConfig,
                             description="the run's NATS, as the controller (hands out tasks, follows "
                             "trajectories and versions, keeps the run's state; its rollout worker takes "
                             "the tasks)")
    state: RunStoreConfig = Field(default_factory=RunStoreConfig,
                                  description="the run's state in JetStream KV: its lease, parts and copy")
    gateway_address: str = Field("", description="host:port of the rollout gateway (admission policy)")
    trainer_address: str = Field("", description="host:port of the trainer (status, checkpoints)")
    broker_address: str = Field("", description="host:port of the weight broker (versions served, promotion)")
    verifier_address: str = Field("", description="host:port of the verifier (scores, audits)")
    session_address: str = Field("", description="host:port of the session server (episodes)")
    sandbox_address: str = Field("", description="host:port of the sandbox manager (episodes' tools)")
    trainer_metrics_url: str = Field("", description="the trainer's Prometheus page (its data-wait counter); "
                                     "empty: the trainer's idle time is not measured")
    resume_on_start: bool = Field(True, description="continue the run the stored state says a controller "
                                  "was driving when it stopped (a restart after a crash, here or on another "
                                  "machine); while another controller holds it, wait for its lease to lapse")
    start_run: str = Field("", description="a run config (TOML, `rlfleet run`'s format) started when the "
                           "controller starts and has no run to resume: how a compose or Kubernetes stack "
                           "trains and gates with nobody calling StartRun")
    keep_lines: int = Field(5000, ge=100,
                            description="progress lines kept for WatchRun (older ones are dropped)")
