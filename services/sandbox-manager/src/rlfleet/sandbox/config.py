"""Configuration of the sandbox-manager service."""

from __future__ import annotations

from pydantic import Field

from rlfleet.common.config import RedisConfig, ServiceConfig


class SandboxManagerConfig(ServiceConfig):
    """Sandbox manager: a fresh isolated sandbox per episode."""

    redis: RedisConfig = Field(default_factory=RedisConfig)
    root: str = Field("/var/lib/rlfleet/sandboxes", description="directory holding sandbox workspaces")
    warm_pool_size: int = Field(4, ge=0, description="sandboxes kept ready for a fast create")
