"""Configuration of a local platform launch (`rlfleet up`): the launch itself, and the real config of
every process it starts, one section each.

A section is the service's own config model, so any key a service takes is set here as it is in the
service's own TOML (`[trainer.loss] algorithm = "gspo"`, `--gateway.max-inflight-sessions 64`,
`RLFLEET__BROKER__SYNC__TRANSPORT=disk_full`). What only the launch knows (peer addresses, the
NATS and Redis URLs, paths in the run directory, the model) the launcher fills in where a section
does not set it (`launch_facts`); `run_id` is set once, at the top, for everyone. Each process then
gets its whole config as one file (`<run_dir>/config/<name>.json`) and `--config`.

These imports are the CLI's only imports of the services: their config models, which are importable
without torch (the import contract in tests/test_import_contract.py allows exactly these).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from rlfleet.broker.config import WeightBrokerConfig
from rlfleet.common.config import ProcessConfig, StrictModel, propagate
from rlfleet.controller.config import ControllerConfig
from rlfleet.engine.config import EngineConfig
from rlfleet.gateway.config import RolloutGatewayConfig
from rlfleet.sandbox.config import SandboxManagerConfig
from rlfleet.session.config import SessionServerConfig
from rlfleet.trainer.service_config import TrainerConfig
from rlfleet.verifier.config import VerifierConfig

ALL_SERVICES = ("sandbox-manager", "rollout-gateway", "trainer", "session-server",
                "weight-broker", "verifier", "controller")
# The section of the launch config that configures each process.
SECTIONS = {"sandbox-manager": "sandbox", "rollout-gateway": "gateway", "trainer": "trainer",
            "session-server": "session", "weight-broker": "broker", "verifier": "verifier",
            "controller": "controller", "cpu-engine": "engine"}
DEFAULT_STOP_TIMEOUT_S = 30.0


class NatsServerConfig(StrictModel):
    binary: str = Field("", description="nats-server executable; empty = the one installed beside "
                        "this Python, else PATH")
    max_payload_bytes: int = Field(8 << 20, ge=1 << 20, le=64 << 20, description="largest NATS message")


class RedisServerConfig(StrictModel):
    binary: str = Field("redis-server", description="redis-server executable")


class RestartPolicy(StrictModel):
    """What the launcher does when a process it started dies: start it again on its own ports."""

    enabled: bool = Field(True, description="restart a process that died (the run goes on)")
    first_backoff_s: float = Field(0.5, ge=0, description="wait before a second try when a restart failed")
    max_backoff_s: float = Field(8.0, gt=0, description="longest wait between tries (doubling up to it)")
    stable_after_s: float = Field(30.0, gt=0, description="a process up this long starts its backoff over")
    standby: list[str] = Field(["trainer", "controller", "session-server", "rollout-gateway", "verifier",
                                "weight-broker", "sandbox-manager"],
                               description="services each kept with a standby beside it (its imports done, "
                                           "waiting), which takes over at once when the service dies")


class ServiceSections(StrictModel):
    """The config of every process a launch starts, as the process itself takes it."""

    sandbox: SandboxManagerConfig = Field(default_factory=SandboxManagerConfig)
    gateway: RolloutGatewayConfig = Field(default_factory=RolloutGatewayConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    session: SessionServerConfig = Field(default_factory=SessionServerConfig)
    broker: WeightBrokerConfig = Field(default_factory=WeightBrokerConfig)
    verifier: VerifierConfig = Field(default_factory=VerifierConfig)
    controller: ControllerConfig = Field(default_factory=ControllerConfig,
                                         description="the run's control (`rlfleet run` "
                                         "starts its runs there)")
    engine: EngineConfig = Field(default_factory=EngineConfig,
                                 description="every CPU engine the launch starts")

    def section(self, process: str) -> ProcessConfig:
        """The config section of `process` (a service name, or "cpu-engine")."""
        return getattr(self, SECTIONS[process])

    def sections(self) -> dict[str, ProcessConfig]:
        return {name: getattr(self, name) for name in SECTIONS.values()}


class PlatformConfig(ServiceSections):
    """Starts NATS (JetStream), Redis and every rlfleet service on free loopback ports."""

    run_id: str = Field("local", pattern=r"^[A-Za-z0-9_-]{1,64}$", description="run namespace")
    run_dir: str = Field("", description="where logs, data and state go; empty = runs/<run_id>")
    services: list[str] = Field(list(ALL_SERVICES), description="services to start")
    start_timeout_s: float = Field(60.0, gt=0, description="give up when a process is not healthy by then")
    # 30 s, as Kubernetes' default grace period: a trainer's last checkpoint on a loaded machine took
    # over 10 s.
    stop_timeout_s: float = Field(DEFAULT_STOP_TIMEOUT_S, gt=0,
                                  description="SIGKILL what has not exited this long after SIGTERM")
    log_format: str = Field("json", pattern="^(json|text)$",
                            description="log format of every process (a section's log.format wins)")
    nats: NatsServerConfig = Field(default_factory=NatsServerConfig)
    redis: RedisServerConfig = Field(default_factory=RedisServerConfig)
    restart: RestartPolicy = Field(default_factory=RestartPolicy)
    engines: int = Field(1, ge=0, le=16, description="CPU engines started before the gateway (0 = none: "
                         "bring your own fleet with gateway.engines)")
    model_path: str = Field("", description="HF model directory the engines serve and the session server "
                            "tokenizes with; empty = the default model, built once into the model cache")
    model_seed: int = Field(0, ge=0, description="seed of the default model (when model_path is empty)")
    model_cache_dir: str = Field("", description="where the default model is built and reused across runs; "
                                 "empty = .cache beside the run directory (runs/.cache)")
    canary_engines: int = Field(0, ge=0,
                                description="how many of the engines form the canary pool (the rest: fleet)")
    candidate_engines: int = Field(0, ge=0, description="how many of the engines after the canary pool's "
                                   "form the candidate pool (the version the promotion gate evaluates)")

    @model_validator(mode="after")
    def _hand_down_the_launch(self) -> PlatformConfig:
        for name, section in self.sections().items():
            if name != "engine":
                propagate(section, {"run_id": self.run_id}, shared=True, where=name)
            propagate(section, {"log": {"format": self.log_format}}, where=name)
        # Without canary engines there is no gate to wait for: versions go straight to the fleet.
        propagate(self.broker, {"auto_promote": not self.canary_engines}, where="broker")
        return self

    @model_validator(mode="after")
    def _pools_fit(self) -> PlatformConfig:
        if self.canary_engines + self.candidate_engines > self.engines:
            raise ValueError(f"canary_engines ({self.canary_engines}) + candidate_engines "
                             f"({self.candidate_engines}) is more than engines ({self.engines})")
        return self
