"""Configuration of the weight-broker service."""

from __future__ import annotations

from pydantic import Field

from rlfleet.common.config import NatsConfig, RedisConfig, ServiceConfig


class WeightBrokerConfig(ServiceConfig):
    """Weight broker: ships policy versions to engines; canary, promotion, rollback."""

    nats: NatsConfig = Field(default_factory=NatsConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    gateway_address: str = Field("", description="host:port of the rollout gateway")
    weight_store: str = Field("", description="weight store root (directory)")
