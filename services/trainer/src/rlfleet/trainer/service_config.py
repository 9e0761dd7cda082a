"""Configuration of the trainer service (importable without torch: `--help` stays instant).

The learning core's own models (`LossConfig`, `BatchConfig`, `OptimConfig`) are nested as they are,
so `--loss.algorithm gspo` or `[optim] lr = 1e-6` in TOML reach the core unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from rlfleet.common.config import NatsConfig, ServiceConfig, StrictModel
from rlfleet.trainer.config import (
    BackendOptions,
    BatchConfig,
    LoraConfig,
    LossConfig,
    MegatronConfig,
    OptimConfig,
    TorchBackendConfig,
)
from rlfleet.weights.config import WeightStoreConfig


class GroupFilterConfig(StrictModel):
    """Which groups are not worth a step, and what happens to a group that never completes."""

    min_samples: int = Field(2, ge=1, description="a group with fewer trainable samples than this is dropped "
                             "(too_few_samples): a group-relative advantage needs company")
    drop_all_equal_rewards: bool = Field(True, description="drop a group whose rewards are all equal "
                                         "(all_equal_rewards): its GRPO/GSPO advantages are all zero "
                                         "(not applied with PPO)")
    timeout_s: float = Field(600.0, gt=0, description="a group still incomplete this long after its first "
                             "sample arrived is closed: see on_timeout")
    on_timeout: Literal["train", "drop"] = Field(
        "train", description="train: a timed-out group is trained with the samples that arrived (if at least "
        "min_samples; late members are then dropped as late_for_group); drop: it is dropped (group_timeout)")


class CheckpointConfig(StrictModel):
    dir: str = Field("", description="checkpoint directory; empty = <weight_store>/../checkpoints/<run_id>")
    every: int = Field(1, ge=1, description="checkpoint every N optimizer steps; trajectories are acked only "
                       "once a checkpoint that includes their training is durable")
    keep: int = Field(2, ge=1, description="checkpoints kept on disk (oldest removed first)")
    on_stop: bool = Field(True, description="write a checkpoint on SIGTERM when steps are not yet in one")


class ConsumerConfig(StrictModel):
    """The durable JetStream pull consumer on the run's TRAJECTORIES subject."""

    name: str = Field("", pattern=r"^[A-Za-z0-9_-]{0,64}$",
                      description="durable consumer name; empty = trainer-<run_id>")
    ack_wait_s: float = Field(10.0, gt=0, description="redelivery after this long without an ack; held "
                              "messages are kept alive with in-progress acks every ack_wait_s / 3, so this "
                              "is also how long a restarted trainer waits for its predecessor's messages")
    max_ack_pending: int = Field(4096, ge=1, description="unacked messages the server lets this consumer "
                                 "hold; must cover the samples of checkpoint.every + 2 steps, prefetched "
                                 "groups and incomplete groups")
    fetch_batch: int = Field(64, ge=1, description="messages asked for per pull")
    fetch_timeout_s: float = Field(1.0, gt=0, description="longest a pull waits for messages")


CRITIC_LR = 1e-5


class ValueModelConfig(StrictModel):
    """PPO with `[trainer.loss] critic = "separate"`: the critic's own model and optimizer (its
    numerics, batch layout and device are the backend's)."""

    model_path: str = Field("", description="HF directory whose trunk the critic starts from (its LM head "
                            "is never run; a zero-initialised value head is added); empty = the policy's "
                            "model_path")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=CRITIC_LR),
                               description="the critic's AdamW and LR schedule (default lr 1e-5, verl's "
                               "critic default, ten times the policy's)")

    @model_validator(mode="before")
    @classmethod
    def _critic_lr_default(cls, data: Any) -> Any:
        # A section that sets other optimizer keys keeps the critic's LR default, not the policy's.
        if isinstance(data, dict) and isinstance(data.get("optim"), dict) and "lr" not in data["optim"]:
            return {**data, "optim": {"lr": CRITIC_LR, **data["optim"]}}
        return data


class WeightSendConfig(StrictModel):
    """Sending each version straight to engines (broadcast, P2P, same-node tensors), as the broker plans
    it; the store gets every version either way. Rank 0 sends (it holds the gathered FSDP2 state)."""

    broker_address: str = Field("", description="host:port of the weight broker; empty = no direct sending "
                                "(engines load versions from the store)")
    master_address: str = Field("127.0.0.1", description="address this trainer hosts broadcast rendezvous on "
                                "(engines in its group must reach it)")
    backend: Literal["", "gloo", "nccl"] = Field("", description="broadcast backend; empty = nccl when the "
                                                 "weights are on a GPU, gloo otherwise")
    p2p_hostname: str = Field("127.0.0.1", description="address of this trainer's Mooncake TransferEngine")
    p2p_protocol: Literal["tcp", "rdma"] = Field("tcp",
                                                 description="Mooncake protocol: tcp, or rdma on a fleet")
    p2p_device: str = Field("", description="Mooncake device name(s) for rdma; empty = auto")
    p2p_every_rank: bool = Field(False, description="under torchrun (torch backend, no LoRA): every rank "
                                 "writes its own FSDP2 shard into P2P staging instead of rank 0 writing the "
                                 "gathered state; the writes then follow the store write instead "
                                 "of running beside it")
    checksum_algorithm: Literal["sha256", "blake2b", "crc32"] = Field(
        "sha256", description="per-tensor checksums engines verify the transfer against")
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="floating tensors are sent in this dtype: the store's served dtype, so "
        "engines updated directly and from the store hold identical weights")
    timeout_s: float = Field(300.0, gt=0, description="longest one direct send (all transports) may take")
    beside_store: bool = Field(True, description="send while the store write runs (the broker flips nothing "
                               "in before the store has the version; a failed write rejects it); false = "
                               "send after the write")
    store_after_flip: bool = Field(True, description="with beside_store, when the broker flips a version in "
                                   "before it is stored (its sync.flip_before_stored): start the store write "
                                   "once the engines flipped it in, so that the write never competes with "
                                   "the transfer and the engines' checks for cores or disk")


class TrainerBackendOptions(BackendOptions):
    """The backend's options (the model itself comes from model_path), and where the proximal policy
    of the clipped ratio comes from."""

    name: Literal["torch", "megatron"] = Field(
        "torch", description="torch: transformers + AdamW, FSDP2 under torchrun; megatron: a Megatron-core "
        "GPTModel converted from model_path by megatron-bridge (Qwen2/Qwen3/Llama), tensor and data "
        "parallel under torchrun (see [megatron])")
    recompute_old_logprobs: bool = Field(True, description="the trainer's own log-probs of each batch before "
                                         "the update are the proximal policy of the clipped ratio (taken "
                                         "from the training pass itself); false: the rollout's log-probs are")


class TrainerConfig(ServiceConfig):
    """Trainer: consumes trajectory groups, steps the policy, checkpoints, publishes versions."""

    nats: NatsConfig = Field(default_factory=NatsConfig)
    model_path: str = Field("", description="HF-format directory of the starting policy; empty = the trainer "
                            "serves health and status but does not train")
    weight_store: str = Field("", description="weight store root (directory)")
    max_staleness: int = Field(4, ge=0, description="drop trajectories whose oldest generated span is more "
                               "than this many versions behind the trainer (stale)")
    group_size: int = Field(8, ge=1, description="samples per group (G) when a trajectory does not say "
                            "(its own `group_size` field wins when set)")
    groups_per_step: int = Field(4, ge=1, description="complete groups per optimizer step")
    prefetch_groups: int = Field(0, ge=0, description="complete groups held ready beyond the next step's; "
                                 "consuming pauses above it (holding more only makes them staler)")
    torch_threads: int = Field(0, ge=0, description="torch intra-op threads; 0 = torch's default")
    group_filter: GroupFilterConfig = Field(default_factory=GroupFilterConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    backend: TrainerBackendOptions = Field(default_factory=TrainerBackendOptions)
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    value_model: ValueModelConfig = Field(default_factory=ValueModelConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig, description="train a LoRA adapter instead of the "
                             "full policy (torch backend only); each version is then an "
                             "adapter on the base version")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    weights: WeightStoreConfig = Field(default_factory=WeightStoreConfig,
                                       description="how each policy version is written to the weight store")
    consumer: ConsumerConfig = Field(default_factory=ConsumerConfig)
    weight_send: WeightSendConfig = Field(default_factory=WeightSendConfig)

    @model_validator(mode="after")
    def _consumer_can_hold_what_is_not_yet_checkpointed(self) -> TrainerConfig:
        # Unacked at once: the steps since the last checkpoint and the one in progress, the groups
        # ready for the next step (and prefetched), and incomplete groups besides.
        held = self.group_size * (self.groups_per_step * (self.checkpoint.every + 2) + self.prefetch_groups)
        if self.consumer.max_ack_pending < held:
            raise ValueError(f"consumer.max_ack_pending ({self.consumer.max_ack_pending}) must be at least "
                             "group_size * (groups_per_step * (checkpoint.every + 2) + "
                             f"prefetch_groups) = {held}: "
                             "trajectories stay unacked until the checkpoint that includes them")
        return self

    @model_validator(mode="after")
    def _megatron_ppo_has_a_shared_critic(self) -> TrainerConfig:
        if self.backend.name == "megatron" and self.uses_value_model:
            raise ValueError("PPO on the Megatron backend trains a shared critic only: set "
                             "[trainer.loss] critic = \"shared\"")
        return self

    @model_validator(mode="after")
    def _lora_needs_the_torch_backend(self) -> TrainerConfig:
        if self.lora.enabled and self.backend.name == "megatron":
            raise ValueError("[trainer.lora] enabled = true needs backend.name = \"torch\": the Megatron "
                             "backend does not train LoRA adapters")
        return self

    @property
    def uses_value_model(self) -> bool:
        """PPO with a separate critic."""
        return self.loss.algorithm == "ppo" and self.loss.critic == "separate"

    @property
    def has_model(self) -> bool:
        return bool(self.model_path)

    def consumer_name(self) -> str:
        return self.consumer.name or f"trainer-{self.run_id}"

    def torch_backend_config(self) -> TorchBackendConfig:
        """The learning core's config of the policy: this service's sections as they are."""
        options = self.backend.model_dump(include=set(BackendOptions.model_fields))
        return TorchBackendConfig(**options, model_dir=self.model_path, optim=self.optim, batch=self.batch,
                                  value_head=self.loss.algorithm == "ppo" and self.loss.critic == "shared",
                                  lora=self.lora)

    def value_model_config(self) -> TorchBackendConfig:
        """The separate critic's config: its own model and optimizer, the backend's numerics
        and batch layout."""
        options = self.backend.model_dump(include=set(BackendOptions.model_fields))
        return TorchBackendConfig(**options, model_dir=self.value_model.model_path or self.model_path,
                                  optim=self.value_model.optim, batch=self.batch, value_head=True,
                                  values_only=True)

    def checkpoint_dir(self) -> Path:
        if self.checkpoint.dir:
            return Path(self.checkpoint.dir)
        return Path(self.weight_store).resolve().parent / "checkpoints" / self.run_id
