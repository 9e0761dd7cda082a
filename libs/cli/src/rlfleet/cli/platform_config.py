"""Configuration of a local platform launch (`rlfleet up`)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from rlfleet.common.config import StrictModel

ALL_SERVICES = ("sandbox-manager", "rollout-gateway", "trainer", "session-server", "weight-broker", "verifier")


class NatsServerConfig(StrictModel):
    binary: str = Field("", description="nats-server executable; empty = the one installed beside this Python, else PATH")
    max_payload_bytes: int = Field(8 << 20, ge=1 << 20, le=64 << 20, description="largest NATS message")


class RedisServerConfig(StrictModel):
    binary: str = Field("redis-server", description="redis-server executable")


class PlatformConfig(StrictModel):
    """Starts NATS (JetStream), Redis and every rlfleet service on free loopback ports."""

    run_id: str = Field("local", pattern=r"^[A-Za-z0-9_-]{1,64}$", description="run namespace")
    run_dir: str = Field("", description="where logs, data and state go; empty = runs/<run_id>")
    services: list[str] = Field(list(ALL_SERVICES), description="services to start")
    start_timeout_s: float = Field(60.0, gt=0, description="give up when a process is not healthy by then")
    stop_timeout_s: float = Field(10.0, gt=0, description="SIGKILL what has not exited this long after SIGTERM")
    log_format: str = Field("json", pattern="^(json|text)$", description="log format of the services")
    nats: NatsServerConfig = Field(default_factory=NatsServerConfig)
    redis: RedisServerConfig = Field(default_factory=RedisServerConfig)
    engines: int = Field(1, ge=0, le=16, description="CPU engines started before the gateway (0 = none: bring "
                         "your own fleet through overrides.rollout-gateway.engines)")
    model_path: str = Field("", description="HF model directory the engines serve and the session server "
                            "tokenizes with; empty = the default model, built once into the model cache")
    model_seed: int = Field(0, ge=0, description="seed of the default model (when model_path is empty)")
    model_cache_dir: str = Field("", description="where the default model is built and reused across runs; "
                                 "empty = .cache beside the run directory (runs/.cache)")
    canary_engines: int = Field(0, ge=0, description="how many of the engines form the canary pool (the rest: fleet)")
    engine_torch_threads: int = Field(1, ge=1, description="torch intra-op threads of each engine")
    overrides: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per-service config overrides, e.g. {\"trainer\": {\"max_staleness\": 2}}")
