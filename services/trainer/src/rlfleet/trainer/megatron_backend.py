"""The Megatron-core training backend: the policy as a tensor-parallel GPTModel (megatron-bridge
converts the HF directory), trained with the same objectives as the torch backend.

Layout: the world (torchrun's ranks, or one process) is TP x DP. Within a TP group every rank sees
the same rows and holds a slice of every layer; the DP groups split the rows of the global batch
(`shard_rows` by data-parallel rank, as FSDP splits them by rank). A micro-batch's loss is its
share of the global mean (losses.LossNorm), computed identically on each TP rank, so gradients
are summed over DP once after the last micro-batch and never scaled by TP: one step at any TP x DP
is the step of one process.

What the loss sees is exactly what the torch backend gives it (`ModelOutputs`: aligned log-probs,
entropy, values), so GRPO, GSPO, PPO and SFT run through the same `LossFn`s (objectives.py,
losses.py). Each policy version is exported back to HF names with the bridge, so the weight
store, the broker and the engines cannot tell which backend trained it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlfleet.trainer import megatron_checkpoint, megatron_cpu
from rlfleet.trainer.backend import LossFn, MetricReducer, ModelOutputs, TrainingBackend
from rlfleet.trainer.batching import TrainBatch, shard_rows
from rlfleet.trainer.config import MegatronConfig, TorchBackendConfig
from rlfleet.trainer.losses import LossNorm, Metrics
from rlfleet.trainer.megatron_model import (
    HiddenStates,
    attention_mask,
    build_policy,
    export_hf_state_dict,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
)
from rlfleet.trainer.megatron_optim import build_optimizer
from rlfleet.trainer.torch_backend import _to_device

NOT_TRAINABLE = "this backend was built with trainable=False: it has no optimizer"


def _init_process_group(device_type: str) -> bool:
    """Joins torchrun's group, or makes a group of one (Megatron's parallel state needs one)."""
    if dist.is_initialized():
        return False
    backend = "nccl" if device_type == "cuda" else "gloo"
    if int(os.environ.get("WORLD_SIZE", "1")) >= 2:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def _init_model_parallel(tensor_parallel: int) -> bool:
    from megatron.core import parallel_state

    world = dist.get_world_size()
    if world % tensor_parallel:
        raise ValueError(f"megatron.tensor_parallel = {tensor_parallel} does not divide "
                         f"the world size {world}")
    if parallel_state.model_parallel_is_initialized():
        current = parallel_state.get_tensor_model_parallel_world_size()
        if current != tensor_parallel:
            raise ValueError(f"this process already runs tensor parallel {current}, not {tensor_parallel}")
        return False
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
    return True


class MegatronBackend(TrainingBackend):
    def __init__(self, cfg: TorchBackendConfig, parallel: MegatronConfig, trainable: bool = True) -> None:
        from megatron.core import parallel_state

        if cfg.model_dir is None:
            raise ValueError("the Megatron backend converts an HF directory: set model_dir")
        self.cfg, self.parallel = cfg, parallel
        self.on_cuda = cfg.device == "cuda"
        if self.on_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.on_cuda \
            else torch.device("cpu")
        self._owns_group = _init_process_group(self.device.type)
        self._owns_model_parallel = _init_model_parallel(parallel.tensor_parallel)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_group = parallel_state.get_data_parallel_group()
        torch.manual_seed(cfg.seed)
        megatron_cpu.seed_rng_tracker(cfg.seed)
        self.policy = build_policy(cfg.model_dir, self.tp_size, cfg.bf16, self.on_cuda)
        self.model = self.policy.model
        self.hidden: HiddenStates | None = None
        if cfg.value_head:
            self._add_value_head()
        self.optimizer = build_optimizer(self.model, cfg.optim, self.on_cuda, parallel.distributed_optimizer,
                                         cfg.bf16) if trainable else None

    def _add_value_head(self) -> None:
        # A submodule of the GPTModel, so Megatron's DDP and the checkpoint cover it; replicated on
        # every TP rank (its input, the final hidden state, is whole on each), zero like the torch one.
        torch.manual_seed(self.cfg.seed)
        head = nn.Linear(self.model.config.hidden_size, 1, device=self.device, dtype=torch.float32)
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
        self.model.value_head = head
        self.hidden = HiddenStates(self.model)

    @property
    def step(self) -> int:
        return self.optimizer.steps if self.optimizer is not None else 0

    @property
    def lm_config(self):
        return self.policy.hf_config

    # ------------------------------------------------------------ forward

    def _forward(self, mb: TrainBatch, with_values: bool, entropy_grad: bool) -> ModelOutputs:
        ids, pos = mb.input_ids.to(self.device), mb.position_ids.to(self.device)
        model = self.optimizer.model if self.optimizer is not None else self.model
        logits = model(ids, pos, attention_mask(pos))
        logprobs = vocab_parallel_logprobs(logits, ids)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = vocab_parallel_entropy(logits)
        values = None
        if with_values:
            if self.hidden is None:
                raise ValueError("the loss needs values but the backend has no value head "
                                 "(set value_head=true)")
            values = self.model.value_head(self.hidden.take().float()).squeeze(-1)
            # The value of the state before token t lives on the hidden state of position t - 1.
            values = nn.functional.pad(values[:, :-1], (1, 0))
        elif self.hidden is not None:
            self.hidden.take()
        return ModelOutputs(logprobs=logprobs, entropy=entropy, values=values)

    def _my_chunks(self, batch: TrainBatch) -> tuple[list[list[int]], int]:
        rows = shard_rows(batch, self.dp_rank, self.dp_size)
        k = self.cfg.batch.micro_batch_rows
        chunks = [rows[i:i + k] for i in range(0, len(rows), k)]
        return chunks, len(chunks)

    @torch.no_grad()
    def forward_inference(self, batch: TrainBatch, with_values: bool = False) -> ModelOutputs:
        self.model.eval()
        chunks, _ = self._my_chunks(batch)
        shape, dev = batch.input_ids.shape, self.device
        logprobs, entropy = torch.zeros(shape, device=dev), torch.zeros(shape, device=dev)
        values = torch.zeros(shape, device=dev) if with_values else None
        for rows in chunks:
            mb = batch.select_rows(rows)
            out = self._forward(mb, with_values, entropy_grad=False)
            idx, width = torch.tensor(rows, device=dev), mb.input_ids.shape[1]
            valid = ((mb.seq_ids >= 0) & (mb.position_ids > 0)).float().to(dev)
            assert out.entropy is not None  # _forward always computes it
            logprobs[idx, :width] = out.logprobs.float() * valid
            entropy[idx, :width] = out.entropy.float() * valid
            if values is not None:
                assert out.values is not None  # with_values: the value head ran
                values[idx, :width] = out.values.float() * valid
        if self.dp_size > 1:
            # Each row was filled by one DP rank (and its TP group) and is zero elsewhere: a sum is a gather.
            for t in (logprobs, entropy, values):
                if t is not None:
                    dist.all_reduce(t, group=self.dp_group)
        self.model.train()
        return ModelOutputs(logprobs=logprobs.cpu(), entropy=entropy.cpu(),
                            values=None if values is None else values.cpu())

    # ------------------------------------------------------------ train

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> Metrics:
        if self.optimizer is None:
            raise RuntimeError("this Megatron backend is a frozen reference: it has no optimizer")
        start = time.perf_counter()
        self.model.train()
        norm = LossNorm(batch.num_loss_tokens, batch.num_seqs, batch.seq_num_loss_tokens.to(self.device))
        needs_values = getattr(loss_fn, "needs_values", False)
        entropy_grad = getattr(loss_fn, "needs_entropy_grad", False)
        chunks, _ = self._my_chunks(batch)
        reducer = MetricReducer()
        lr = self.optimizer.lr()
        for rows in chunks:
            mb = _to_device(batch.select_rows(rows), self.device)
            loss, metrics = loss_fn(self._forward(mb, needs_values, entropy_grad), mb, norm)
            (loss * self.optimizer.loss_scale).backward()
            reducer.add(metrics, float(mb.loss_mask.sum()))
        # A DP rank with fewer micro-batches contributes zero gradients to the one reduction.
        grad_norm, stepped = self.optimizer.step()
        out = self._gather_metrics(reducer)
        tokens = int((batch.seq_ids >= 0).sum())
        elapsed = time.perf_counter() - start
        out.update(grad_norm=grad_norm, lr=lr, step=self.step, skipped=float(not stepped), tokens=tokens,
                   loss_tokens=batch.num_loss_tokens, seqs=batch.num_seqs, step_time_s=elapsed,
                   tokens_per_s=tokens / elapsed)
        return out

    def _gather_metrics(self, reducer: MetricReducer) -> Metrics:
        if self.dp_size == 1:
            return reducer.result()
        everyone: list[MetricReducer | None] = [None] * self.dp_size
        dist.all_gather_object(everyone, reducer, group=self.dp_group)
        return MetricReducer.combine(r for r in everyone if r is not None).result()

    def set_lr(self, lr: float) -> None:
        assert self.optimizer is not None, NOT_TRAINABLE
        self.optimizer.set_lr(lr)

    # ------------------------------------------------------------ export and checkpoints

    def state_dict_for_export(self) -> dict[str, torch.Tensor]:
        state = export_hf_state_dict(self.policy)  # collective over the TP group
        return state if self.rank == 0 else {}

    def save_hf(self, out_dir: str | Path) -> None:
        megatron_checkpoint.save_hf(self, Path(out_dir))

    def state_dict(self) -> dict[str, Any]:
        """Stateful, per TP shard (megatron_checkpoint.py lays it out): this rank's parameters, its
        optimizer state, and the schedule with the parallel layout; collective."""
        assert self.optimizer is not None, NOT_TRAINABLE
        return {"model": {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters()},
                "optimizer": self.optimizer.state_dict(),
                "trainer": {"backend": "megatron", "tensor_parallel": self.tp_size,
                            "data_parallel": self.dp_size, "schedule": self.optimizer.schedule_state()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        megatron_checkpoint.check_layout(state["trainer"], self.tp_size, "the state")
        assert self.optimizer is not None, NOT_TRAINABLE
        params = dict(self.model.named_parameters())
        missing, unexpected = set(params) - set(state["model"]), set(state["model"]) - set(params)
        if missing or unexpected:
            raise megatron_checkpoint.CheckpointLayoutError(
                f"parameters differ from the model's (missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]})")
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(state["model"][name])
        self.optimizer.load_state_dict(state["optimizer"])
        self.optimizer.load_schedule_state(state["trainer"]["schedule"])

    def save_checkpoint(self, ckpt_dir: str | Path) -> None:
        megatron_checkpoint.save_checkpoint(self, Path(ckpt_dir))

    def load_checkpoint(self, ckpt_dir: str | Path) -> None:
        megatron_checkpoint.load_checkpoint(self, Path(ckpt_dir))

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def close(self) -> None:
        from megatron.core import parallel_state

        if self._owns_model_parallel and parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
            self._owns_model_parallel = False
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False

