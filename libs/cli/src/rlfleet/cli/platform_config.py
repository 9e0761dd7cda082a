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
    overrides: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per-service config overrides, e.g. {\"trainer\": {\"max_staleness\": 2}}")
