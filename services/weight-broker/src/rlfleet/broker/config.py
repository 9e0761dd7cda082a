"""Configuration of the weight-broker service."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlfleet.common.config import NatsConfig, RedisConfig, ServiceConfig, StrictModel

TransportName = Literal["disk_delta", "disk_full", "distributed", "p2p", "tensor"]
# Transports whose bytes come from the trainer (StartTrainerSync); the others read the weight store.
TRAINER_SENT = ("distributed", "p2p", "tensor")
PoolName = Literal["canary", "candidate", "fleet"]
PauseModeName = Literal["abort", "retract", "in_place"]


class StaticEngine(StrictModel):
    engine_id: str = Field(min_length=1, description="the engine's name in the broker's status")
    url: str = Field(min_length=1, description="base URL of its SGLang-compatible HTTP API")
    pool: PoolName = Field("fleet", description="canary (gets new versions first), candidate (the version "
                           "pinned for the promotion gate) or fleet")
    kind: Literal["cpu", "sglang"] = Field(
        "sglang", description="cpu (rlfleet's CPU engine: in-engine store deltas) or sglang (a real SGLang "
        "server: full HF directories only, deltas applied by the node-local weight agent)")
    transport: TransportName | None = Field(
        None, description="this engine's transport; empty = sync.engine_transports, then sync.transport")


class SyncConfig(StrictModel):
    """When and how versions go to engines."""

    transport: TransportName = Field(
        "disk_delta",
        description="every engine's transport unless engine_transports says otherwise: disk_delta (fetch + "
        "decode a store delta before a pause that covers only the swap; full load when no delta applies), "
        "disk_full (always a full load); straight from the trainer (StartTrainerSync; an engine whose "
        "transfer fails catches up from the store): distributed (torch.distributed broadcast, for engines "
        "in the trainer's group), p2p (the trainer writes into the engine's Mooncake staging buffer, for "
        "reachable peers), tensor (update_weights_from_tensor, for an engine on the trainer's node)",
    )
    engine_transports: dict[str, TransportName] = Field(
        default_factory=dict, description="engine_id -> transport, overriding transport per engine "
        '(e.g. {"e0": "distributed", "e1": "p2p"}); engines not named take transport')
    trainer_wait_s: float = Field(
        30.0, gt=0, description="with trainer-sent transports, a version announced this long ago that no "
        "trainer has started sending is synced from the store (a trainer not configured to send)")
    p2p_bucket_bytes: int = Field(64 << 20, ge=1 << 16, description="bytes per P2P write batch")
    flip_before_stored: bool = Field(
        True, description="with trainer-sent transports and the store write beside the send: engines flip a "
        "version in as soon as it arrived and passed its checksums, before the store has it (the store "
        "write then leaves the update's critical path); a write that fails afterwards rejects the version "
        "and sends those engines back to their targets from the store. false: nothing is flipped in "
        "before the store holds the version")
    every_n_versions: int = Field(
        1, ge=1, description="sync a version when it is at least this many versions past the last synced one"
    )
    max_lag_s: float = Field(
        0.0,
        ge=0,
        description="sync the newest waiting version once a version has waited this long, even when "
        "every_n_versions says to wait; 0 = off",
    )
    max_delta_chain: int = Field(
        4,
        ge=1,
        description="an engine at most this many store versions behind catches up delta by delta; further "
        "behind (or on an unknown version) it gets one full load",
    )
    pause_mode: PauseModeName = Field(
        "retract", description="how engines pause around a swap: abort | retract | in_place (SGLang's modes)"
    )
    update_timeout_s: float = Field(600.0, gt=0, description="longest one engine weight update may take")
    drain_stale_engines: bool = Field(
        True,
        description="have the gateway mark an engine DRAINING while it catches up from weights that are no "
        "version of this run (a new or restarted engine), and HEALTHY once it serves its target",
    )


def transport_of(sync: SyncConfig, engine_id: str, own: str = "") -> str:
    """An engine's transport: its own (static list), else sync.engine_transports, else sync.transport."""
    return own or sync.engine_transports.get(engine_id) or sync.transport


class WeightBrokerConfig(ServiceConfig):
    """Weight broker: ships policy versions to engines; canary, promotion, rollback."""

    nats: NatsConfig = Field(default_factory=NatsConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    gateway_address: str = Field(
        "", description="host:port of the rollout gateway (engines come from its ListEngines); "
        "empty = use engines"
    )
    weight_store: str = Field("", description="weight store root (directory shared with the trainer and "
                              "engines)")
    engines: list[StaticEngine] = Field(
        default_factory=list,
        description="static engine list, used when no gateway_address is set "
        '(e.g. [{"engine_id": "e0", "url": "http://10.0.0.5:30000", "pool": "canary"}])',
    )
    sync: SyncConfig = Field(default_factory=SyncConfig)
    local_copies: str = Field(
        "", description="broker-mode weight agent: directory of the full local copies SGLang engines load "
        "(each engine must read it at the same path: node-local disk beside a single node, or shared); "
        "empty = <weight_store>/.local-copies")
    engine_api_key: str = Field("", description="SGLang's --api-key of the engines (Authorization: Bearer)")
    engine_admin_api_key: str = Field(
        "", description="SGLang's --admin-api-key, sent on the weight routes; empty = engine_api_key")
    auto_promote: bool = Field(
        False,
        description="promote a version to the fleet as soon as the canary pool serves it (no promotion "
        "gate); with no canary engines, at once",
    )
    reconcile_interval_s: float = Field(
        2.0, gt=0, description="how often every engine's weight version is compared with its pool's target"
    )
    consume_policy_stream: bool = Field(
        True,
        description="take version announcements from the POLICY stream (PublishVersion works either way)"
    )

    @property
    def trainer_sends(self) -> bool:
        """Whether any engine may take versions straight from the trainer (StartTrainerSync)."""
        named = [self.sync.transport, *self.sync.engine_transports.values(),
                 *(e.transport for e in self.engines if e.transport)]
        return any(t in TRAINER_SENT for t in named)

    @model_validator(mode="after")
    def _one_engine_source(self) -> WeightBrokerConfig:
        if self.gateway_address and self.engines:
            raise ValueError("set either gateway_address (engines from the gateway) or engines, not both")
        ids = [e.engine_id for e in self.engines]
        if len(ids) != len(set(ids)):
            raise ValueError("engine_id values in engines must be unique")
        return self
