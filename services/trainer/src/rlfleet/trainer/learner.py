"""The learning core as the service drives it: one backend, run on one worker thread.

Every torch call (load, step, checkpoint, export) and the weight-store write go through the same
single thread, so torch always sees one caller and the asyncio loop stays free to serve gRPC,
keep held messages alive and consume the next groups while a step runs.

Under torchrun (WORLD_SIZE >= 2) rank 0 is the service: it consumes, groups, checkpoints and
publishes, and before each collective operation it broadcasts the operation and its arguments
(the whole batch of samples, a checkpoint path) to the other ranks, which run `follow`: no gRPC,
no NATS, just the same calls on their shard (FSDP2). Checkpoint paths must be on a filesystem
every rank sees (each rank writes its RNG state there).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from rlfleet.trainer.config import LoraConfig, TorchBackendConfig
from rlfleet.trainer.service_config import TrainerConfig

if TYPE_CHECKING:
    from rlfleet.trainer.backend import TrainingBackend
    from rlfleet.trainer.p2p_shards import ShardWriter
    from rlfleet.trainer.value_model import ValueModel

T = TypeVar("T")
log = logging.getLogger(__name__)


class Worker:
    """One thread for everything heavy."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-worker")

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def model_limits(model_path: str) -> tuple[int, int]:
    """(vocab size, max positions) from the model's config.json."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    return int(text["vocab_size"]), int(text.get("max_position_embeddings") or 1 << 30)


class LearnerCore:
    """What every rank runs: the backend(s) and the collective operations, called by name."""

    COMMANDS = ("train", "save_checkpoint", "load_checkpoint", "export", "export_base", "export_adapter",
                "send_p2p_shards", "noop", "close")

    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        self.backend: TrainingBackend | None = None
        self.reference: TrainingBackend | None = None
        self.value_model: ValueModel | None = None
        self.shard_writer: ShardWriter | None = None

    @property
    def world_size(self) -> int:
        return self.backend.world_size if self.backend is not None else 1

    @property
    def policy(self) -> TrainingBackend:
        """The policy's backend, once `load` built it."""
        assert self.backend is not None, "load() first"
        return self.backend

    def load(self) -> None:
        import torch
        import transformers


        transformers.utils.logging.disable_progress_bar()  # no progress bars in JSON logs
        if self.config.torch_threads:
            torch.set_num_threads(self.config.torch_threads)
        cfg = self.config.torch_backend_config()
        # Under torchrun: joins the process group, shards the model (FSDP2, or Megatron's TP x DP).
        self.backend = self._build(cfg)
        if self.config.loss.kl_coef > 0:
            # The frozen starting policy, for the KL penalty; never stepped.
            self.reference = self._build(cfg.model_copy(update={"value_head": False, "lora": LoraConfig()}),
                                         trainable=False)
        if self.config.uses_value_model:
            from rlfleet.trainer.value_model import TorchValueModel

            self.value_model = TorchValueModel(self.config.value_model_config())

    def _build(self, cfg: TorchBackendConfig, trainable: bool = True) -> TrainingBackend:
        if self.config.backend.name == "megatron":
            from rlfleet.trainer.megatron_backend import MegatronBackend

            return MegatronBackend(cfg, self.config.megatron, trainable=trainable)
        from rlfleet.trainer.torch_backend import TorchBackend

        return TorchBackend(cfg)

    def train(self, samples: list[Any]) -> dict[str, float]:
        from rlfleet.trainer.objectives import rl_step

        start = time.perf_counter()
        metrics = rl_step(self.policy, samples, self.config.loss, self.config.batch, reference=self.reference,
                          recompute_old_logprobs=self.config.backend.recompute_old_logprobs,
                          value_model=self.value_model)
        metrics["rl_step_s"] = time.perf_counter() - start  # batch assembly, old log-probs, update
        return metrics

    def save_checkpoint(self, ckpt_dir: Path) -> None:
        self.policy.save_checkpoint(ckpt_dir)
        if self.value_model is not None:
            from rlfleet.trainer.value_model import VALUE_MODEL_DIR

            # Inside the same checkpoint directory: one rename makes both durable, or neither.
            self.value_model.save_checkpoint(Path(ckpt_dir) / VALUE_MODEL_DIR)

    def load_checkpoint(self, ckpt_dir: Path) -> None:
        self.policy.load_checkpoint(ckpt_dir)
        if self.value_model is not None:
            from rlfleet.trainer.value_model import VALUE_MODEL_DIR

            self.value_model.load_checkpoint(Path(ckpt_dir) / VALUE_MODEL_DIR)

    def export(self) -> dict[str, Any]:
        """The policy's HF-named fp32 state dict (full on rank 0, empty elsewhere)."""
        return self.policy.state_dict_for_export()

    def export_base(self) -> dict[str, Any]:
        """LoRA: the frozen base model's HF-named state dict (what every adapter version applies to)."""
        return self.policy.base_state_for_export()

    def export_adapter(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """LoRA: the adapter's tensors (peft's names) and its adapter_config.json."""
        return self.policy.adapter_for_export()

    def send_p2p_shards(self, peers: list[tuple[str, str]], bucket_bytes: int) -> list | None:
        """Every rank writes its own shards into each engine's P2P staging; rank 0 gets all results."""
        from rlfleet.trainer.p2p_shards import ShardWriter, write_and_gather

        writer = self.shard_writer = self.shard_writer or ShardWriter()
        return write_and_gather(writer, self.policy, peers, bucket_bytes, self.config.weight_send)

    def noop(self) -> None:
        """Keeps the followers' wait for the next command under the process group's timeout."""

    def close(self) -> None:
        if self.shard_writer is not None:
            self.shard_writer.close()
        for b in (self.value_model, self.reference, self.backend):  # the policy's owns the process group
            if b is not None:
                b.close()


def _broadcast_command(command: list[Any]) -> list[Any]:
    import torch.distributed as dist

    dist.broadcast_object_list(command, src=0)
    return command


def follow(config: TrainerConfig) -> None:
    """Ranks >= 1 under torchrun: do what rank 0 (the service) says, collectively, until it says close."""
    core = LearnerCore(config)
    core.load()
    while True:
        name, args = _broadcast_command([None, None])
        if name not in LearnerCore.COMMANDS:
            raise RuntimeError(f"rank 0 sent an unknown command {name!r}")
        getattr(core, name)(*args)
        if name == "close":
            log.info("rank %d: closed by rank 0", core.policy.rank)
            return


class Learner:
    """The service's side (rank 0): every operation runs on the worker thread; under torchrun it is
    first broadcast to the other ranks, which run it with the same arguments (see `follow`)."""

    keep_alive_s = 60.0

    def __init__(self, config: TrainerConfig, worker: Worker) -> None:
        self.config = config
        self.worker = worker
        self.core = LearnerCore(config)

    @property
    def backend(self):
        return self.core.backend

    @property
    def step(self) -> int:
        return self.core.backend.step if self.core.backend is not None else 0

    def run(self, name: str, *args: Any) -> Any:
        """On the worker thread: tells the followers, then does it here."""
        if self.core.world_size > 1:
            _broadcast_command([name, args])
        return getattr(self.core, name)(*args)

    async def load(self) -> None:
        await self.worker.call(self.core.load)

    async def train(self, samples: Sequence[Any]) -> dict[str, float]:
        return await self.worker.call(self.run, "train", list(samples))

    def save_checkpoint(self, ckpt_dir: Path) -> None:
        """On the worker thread (the Checkpointer calls it there)."""
        self.run("save_checkpoint", ckpt_dir)

    async def load_checkpoint(self, ckpt_dir: Path) -> None:
        await self.worker.call(self.run, "load_checkpoint", ckpt_dir)

    def export(self) -> dict[str, Any]:
        """On the worker thread: the policy's HF-named fp32 state dict."""
        return self.run("export")

    def export_base(self) -> dict[str, Any]:
        """On the worker thread (LoRA): the frozen base model's HF-named state dict."""
        return self.run("export_base")

    def export_adapter(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """On the worker thread (LoRA): the adapter's tensors and adapter_config.json."""
        return self.run("export_adapter")

    @property
    def sends_own_shards(self) -> bool:
        """P2P writes from every rank (`weight_send.p2p_every_rank`): torch backend, FSDP2, no LoRA."""
        return (self.config.weight_send.p2p_every_rank and self.core.world_size > 1
                and self.config.backend.name == "torch" and not self.config.lora.enabled)

    def send_p2p_shards(self, peers: list, bucket_bytes: int) -> list:
        """On the worker thread: every rank's shards into the plan's P2P engines; one PeerResult each."""
        from rlfleet.trainer.p2p_shards import merged

        targets = [(p.engine_id, p.endpoint_json) for p in peers]
        gathered = self.run("send_p2p_shards", targets, bucket_bytes)
        log.info("P2P shards written by %d ranks: %s", self.core.world_size, "; ".join(
            f"{engine_id} " + ", ".join(f"rank {rank} {g[engine_id][1]} "
                                        f"B{'' if g[engine_id][0] else ' FAILED'}"
                                        for rank, g in enumerate(gathered))
            for engine_id, _ in targets))  # fmt: skip
        return merged(targets, gathered)

    async def keep_alive(self) -> None:
        while True:
            await asyncio.sleep(self.keep_alive_s)
            if self.core.world_size > 1:
                await self.worker.call(self.run, "noop")

    def close(self) -> None:
        """On the worker thread; releases the followers too."""
        if self.core.backend is not None:
            self.run("close")
