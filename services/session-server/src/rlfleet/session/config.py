"""Configuration of the session-server service."""

from __future__ import annotations

from pydantic import Field

from rlfleet.common.config import NatsConfig, RedisConfig, ServiceConfig


class SessionServerConfig(ServiceConfig):
    """Session server: token-in-token-out sessions closed into trajectories."""

    nats: NatsConfig = Field(default_factory=NatsConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    gateway_address: str = Field("", description="host:port of the rollout gateway")
    tokenizer_path: str = Field("", description="directory with tokenizer.json (and tokenizer_config.json)")
    max_total_tokens: int = Field(4096, gt=0, description="default token budget per session")
    max_open_sessions: int = Field(4096, gt=0, description="open sessions allowed at once")
