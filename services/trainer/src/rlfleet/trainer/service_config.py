"""Configuration of the trainer service."""

from __future__ import annotations

from pydantic import Field

from rlfleet.common.config import NatsConfig, ServiceConfig


class TrainerConfig(ServiceConfig):
    """Trainer: consumes trajectory groups, steps the policy, publishes versions."""

    nats: NatsConfig = Field(default_factory=NatsConfig)
    model_path: str = Field("", description="HF-format directory of the starting policy")
    weight_store: str = Field("", description="weight store root (directory)")
    max_staleness: int = Field(4, ge=0, description="drop trajectories older than this many versions")
