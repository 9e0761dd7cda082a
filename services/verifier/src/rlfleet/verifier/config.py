"""Configuration of the verifier service."""

from __future__ import annotations

from pydantic import Field

from rlfleet.common.config import RedisConfig, ServiceConfig


class VerifierConfig(ServiceConfig):
    """Verifier: scores episodes; rewards with structured failure reasons."""

    redis: RedisConfig = Field(default_factory=RedisConfig)
    sandbox_address: str = Field("", description="host:port of the sandbox manager")
    session_address: str = Field("", description="host:port of the session server")
    suites_dir: str = Field("", description="directory of task suites (JSONL) with their hidden answers/tests")
