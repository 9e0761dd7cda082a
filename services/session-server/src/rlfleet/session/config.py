"""Configuration of the session-server service."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlfleet.common.config import NatsConfig, RedisConfig, ServiceConfig


class SessionServerConfig(ServiceConfig):
    """Session server: token-in-token-out sessions closed into trajectories."""

    nats: NatsConfig = Field(default_factory=NatsConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    gateway_address: str = Field("", description="host:port of the rollout gateway")
    tokenizer_path: str = Field("", description="directory with tokenizer.json (and tokenizer_config.json)")
    chat_template: Literal["auto", "builtin"] = Field(
        "auto", description="auto: the tokenizer's chat_template (sandboxed jinja) when it has one, else "
        "rlfleet's built-in ChatML; builtin: always the built-in")
    context_length: int = Field(
        0, ge=0,
        description="most tokens a session may reach; 0 = the model's (config.json or tokenizer_config.json)")
    max_total_tokens: int = Field(4096, gt=0, description="default token budget per session")
    max_open_sessions: int = Field(4096, gt=0, description="open sessions allowed at once")
    session_ttl_s: float = Field(
        24 * 3600.0, gt=0,
        description="a session (open or closed) is forgotten this long after its last change")
    session_idle_timeout_s: float = Field(
        3600.0, gt=0, description="an open session with no call for this long is expired: published ABORTED "
        "(abort_reason expired), its admission slot released, and answered as expired afterwards")
    expiry_sweep_s: float = Field(10.0, gt=0, description="how often idle sessions are looked for")
    gateway_timeout_s: float = Field(600.0, gt=0, description="deadline of one Generate call to the gateway")
    publish_timeout_s: float = Field(5.0, gt=0, description="deadline of one publish to JetStream")
    max_text_chars: int = Field(1 << 20, gt=0,
                                description="largest text (or chat message) a request may carry")
    max_metadata_bytes: int = Field(64 << 10, gt=0,
                                    description="largest total size of a request's metadata map")
