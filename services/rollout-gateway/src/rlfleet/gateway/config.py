"""Configuration of the rollout-gateway service."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlfleet.common.config import RedisConfig, ServiceConfig, StrictModel


class EngineSpec(StrictModel):
    """An engine the gateway registers at start-up (more can be registered by RPC)."""

    engine_id: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$", description="unique name of the engine")
    url: str = Field(pattern=r"^https?://", description="base URL of its SGLang-compatible HTTP API")
    pool: Literal["fleet", "canary", "candidate"] = Field(
        "fleet", description="fleet, canary, or candidate (the version the promotion gate evaluates)")
    kind: Literal["cpu", "sglang"] = Field("cpu",
                                           description="the built-in CPU engine or a real SGLang server")


class RolloutGatewayConfig(ServiceConfig):
    """Rollout gateway: routes generate calls to engines, admission control, pause/resume."""

    redis: RedisConfig = Field(default_factory=RedisConfig)
    engines: list[EngineSpec] = Field(
        default_factory=list,
        description='engines registered at start, e.g. [{"engine_id": "e0", "url": "http://127.0.0.1:30000"}]')
    health_interval_s: float = Field(2.0, gt=0, description="how often engines are health-checked")
    health_generate: bool = Field(
        False, description="probe with /health_generate (runs the model) instead of /health")
    max_inflight_sessions: int = Field(0, ge=0, description="admission limit on open sessions; 0 = unlimited")
    route_pools: list[Literal["fleet", "canary"]] = Field(
        ["fleet", "canary"], description="pools that take sessions not pinned to a pool (an RL loop with a "
        "promotion gate routes rollouts to the canary pool, which gets every new version)")
    max_staleness: int = Field(
        -1, description="admission staleness budget in policy versions until SetAdmissionPolicy; <0 = off")
    admission_lease_s: float = Field(
        6 * 3600.0, gt=0,
        description="an admitted session that is never released frees its slot after this long")
    retry_after_ms: int = Field(500, ge=0, description="retry hint given with a refused admission")
    affinity_ttl_s: float = Field(
        3600.0, gt=0, description="a session's engine affinity expires after this long without a turn")
    generate_timeout_s: float = Field(600.0, gt=0, description="longest one engine generate call may take")
    control_timeout_s: float = Field(30.0, gt=0, description="timeout of health, pause and resume calls")
    connect_timeout_s: float = Field(2.0, gt=0, description="TCP connect timeout to an engine")
    engine_api_key: str = Field(
        "", description="SGLang's --api-key of the engines, sent as `Authorization: Bearer`; empty = none")
    engine_admin_api_key: str = Field(
        "", description="SGLang's --admin-api-key, sent on admin routes (pause, continue, abort); "
        "empty = engine_api_key")
