"""Configuration of the rollout-gateway service."""

from __future__ import annotations

from pydantic import Field

from rlfleet.common.config import RedisConfig, ServiceConfig


class RolloutGatewayConfig(ServiceConfig):
    """Rollout gateway: routes generate calls to engines, admission control, pause/resume."""

    redis: RedisConfig = Field(default_factory=RedisConfig)
    health_interval_s: float = Field(2.0, gt=0, description="how often engines are health-checked")
    max_inflight_sessions: int = Field(0, ge=0, description="admission limit on open sessions; 0 = unlimited")
