"""Configuration of a rollout worker (`rlfleet-worker`, or `RolloutWorker` embedded in-process)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlfleet.common.config import NatsConfig, ProcessConfig, StrictModel


class SamplingDefaults(StrictModel):
    """Sampling for tasks that leave a field unset (a task's own values win)."""

    temperature: float = Field(1.0, ge=0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling")
    top_k: int = Field(-1, ge=-1, description="-1 = off")
    max_new_tokens: int = Field(256, gt=0, description="tokens per assistant turn when the task gives none")
    seed: int | None = Field(None, description="set: every episode samples with a seed derived from "
                             "this and its session ID")


class AdmissionConfig(StrictModel):
    """Retrying refusals (RESOURCE_EXHAUSTED) of OpenSession and CreateSandbox."""

    first_backoff_s: float = Field(0.1, gt=0, description="first wait after a refusal")
    max_backoff_s: float = Field(5.0, gt=0, description="longest wait between retries")
    give_up_after_s: float = Field(600.0, gt=0,
                                   description="then the episode fails (and is retried on redelivery)")


class WorkerConfig(ProcessConfig):
    """Rollout worker: takes tasks from TASKS, runs each as a group of G episodes, acks when
    all are published."""

    run_id: str = Field("default", pattern=r"^[A-Za-z0-9_-]{1,64}$",
                        description="run namespace for streams and keys")
    nats: NatsConfig = Field(default_factory=NatsConfig)
    session_address: str = Field("", description="host:port of the session server")
    sandbox_address: str = Field("", description="host:port of the sandbox manager")
    verifier_address: str = Field("", description="host:port of the verifier")
    token: str = Field("", description="this worker's environment-client token (`rlfleet token issue`); "
                       "empty: $RLFLEET_TOKEN, or the run's secrets directory")
    token_file: str = Field("", description="a file holding the token (a compose or Kubernetes secret); "
                            "read at start when `token` is empty")
    ca_file: str = Field("", description="the run's CA certificate (<run_dir>/secrets/ca.pem); empty: "
                         "$RLFLEET_CA_FILE, or the run's secrets directory")
    concurrency: int = Field(8, ge=1, description="episodes this worker runs at once (all groups together)")
    episode_timeout_s: float = Field(60.0, gt=0,
                                     description="time limit of one episode when its task gives none")
    max_episode_timeout_s: float = Field(600.0, gt=0, description="a task's own time limit is capped at this")
    default_group_size: int = Field(1, ge=1, description="samples per task when the task gives none")
    max_group_size: int = Field(64, ge=1,
                                description="a task asking for more samples is refused as a bad task")
    tool_runtime: Literal["sandbox", "in_process"] = Field(
        "sandbox", description="sandbox: a fresh sandbox per episode; in_process: suites whose tools are "
        "pure functions (calc) run them in this worker with no sandbox, the others still get one")
    max_total_tokens: int = Field(0, ge=0,
                                  description="token budget per session; 0 = the session server's default")
    tool_call_format: Literal["tags", "hermes", "llama3_json", "mistral"] = Field(
        "tags", description="how the model writes tool calls (rlfleet.common.tool_calls): tags = the "
        "built-in <calc>...</calc>; hermes, llama3_json, mistral = those families' formats")
    observation_framing: Literal["chatml", "template"] = Field(
        "chatml", description="chatml: observations framed as ChatML text here (the default model's "
        "template); template: sent as chat messages that the session server frames with the model's own "
        "template (any model family)")
    sampling: SamplingDefaults = Field(default_factory=SamplingDefaults)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    consumer: str = Field("rollout-workers", pattern=r"^[A-Za-z0-9_-]{1,64}$",
                          description="durable consumer name prefix; workers sharing it share the tasks")
    # Short: running groups heartbeat every ack_wait/4, so this bounds only how long a dead worker's
    # tasks wait. Tied to the episode timeout (90 s) it held a killed controller's groups back 87 s.
    ack_wait_s: float = Field(15.0, ge=0, description="a task is redelivered this long after its worker "
                              "went silent (running groups send heartbeats every ack_wait/4); "
                              "0 = episode_timeout_s + 30")
    max_deliver: int = Field(5, ge=1, description="deliveries of a task before it is dead-lettered")
    nak_delay_s: float = Field(2.0, ge=0,
                               description="wait before redelivering a group that could not finish")
    platform_wait_s: float = Field(300.0, gt=0, description="a group stopped by a service outage holds its "
                                   "delivery this long at most, waiting for the services to answer again")
    platform_backoff_max_s: float = Field(2.0, gt=0, description="longest wait between health checks then")
    drain_timeout_s: float = Field(30.0, ge=0, description="on stop, time in-flight groups get to finish")
    ready_file: str = Field("", description="write {pid, metrics_port} as JSON here once consuming")

    @property
    def effective_ack_wait_s(self) -> float:
        return self.ack_wait_s or self.episode_timeout_s + 30.0

    @property
    def heartbeat_s(self) -> float:
        """How often a running group tells JetStream it is still in progress."""
        return max(0.5, self.effective_ack_wait_s / 4)
