"""The Megatron backend's optimizer, one interface for two stacks.

- `TorchAdamW` (CPU, and CUDA without the distributed optimizer): `torch.optim.AdamW` on this rank's
  parameters (its TP shard; AdamW is elementwise, so a sharded AdamW is the full one). Gradients
  are summed over the data-parallel group after the last micro-batch (each micro-batch's loss is its
  share of the global mean), the global norm is taken over the TP group counting replicated
  parameters once, and clipping and the non-finite skip match the torch backend.
- `DistributedOptimizer` (CUDA): Megatron's `DistributedDataParallel` (fp32 gradient buffers,
  reduce-scatter over data parallel) and `get_megatron_optimizer` with `use_distributed_optimizer`
  (fp32 main weights and Adam state sharded over the data-parallel ranks, bf16 model weights),
  which clips and skips on its own. Written against megatron-core 0.16.1's API; no GPU was
  available to run it (see the trainer README).

Both keep the LR schedule of the torch backend (`torch_backend.lr_factor`), so a step is the same
step on either backend.
"""

from __future__ import annotations

import abc
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from rlfleet.trainer.config import OptimConfig
from rlfleet.trainer.torch_backend import lr_factor

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel


class MegatronOptimizer(abc.ABC):
    """What the backend needs from an optimizer: scale, step, state, LR."""

    model: nn.Module  # what to call forward on (the DDP wrapper, where there is one)
    loss_scale: float = 1.0  # multiply each micro-batch's loss by this before backward

    def __init__(self, cfg: OptimConfig) -> None:
        self.cfg = cfg
        self.peak_lr = cfg.lr
        self.steps = 0

    def lr(self) -> float:
        return self.peak_lr * lr_factor(self.steps, self.cfg)

    def set_lr(self, lr: float) -> None:
        self.peak_lr = lr
        self._apply_lr()

    @abc.abstractmethod
    def _apply_lr(self) -> None: ...

    @abc.abstractmethod
    def zero_grad(self) -> None: ...

    @abc.abstractmethod
    def step(self) -> tuple[float, bool]:
        """(global grad norm before clipping, whether the weights were updated)."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state (its TP shard); collective over the data-parallel group."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def schedule_state(self) -> dict[str, Any]:
        return {"steps": self.steps, "peak_lr": self.peak_lr}

    def load_schedule_state(self, state: dict[str, Any]) -> None:
        self.steps, self.peak_lr = int(state["steps"]), float(state["peak_lr"])
        self._apply_lr()


class TorchAdamW(MegatronOptimizer):
    def __init__(self, model: nn.Module, cfg: OptimConfig, dp_group, tp_group) -> None:
        super().__init__(cfg)
        self.model = model
        self.dp_group, self.tp_group = dp_group, tp_group
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=self.lr(), betas=cfg.betas, eps=cfg.eps,
                                           weight_decay=cfg.weight_decay)

    def _apply_lr(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> tuple[float, bool]:
        self._sum_gradients_over_data_parallel()
        norm = self._global_grad_norm()
        stepped = math.isfinite(norm)
        if stepped:
            # The coefficient of torch.nn.utils.clip_grad_norm_ (what the torch backend uses).
            coef = min(self.cfg.max_grad_norm / (norm + 1e-6), 1.0) if self.cfg.max_grad_norm else 1.0
            if coef < 1.0:
                for p in self.params:
                    if p.grad is not None:
                        p.grad.mul_(coef)
            self.optimizer.step()
            self.steps += 1
            self._apply_lr()
        self.zero_grad()
        return norm, stepped

    def _sum_gradients_over_data_parallel(self) -> None:
        if self.dp_group.size() == 1:
            return
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self.dp_group)

    def _global_grad_norm(self) -> float:
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        squares = torch.zeros((), dtype=torch.float64, device=self.params[0].device)
        for p in self.params:
            # A replicated parameter (norm weights, the value head) has the same gradient on every
            # TP rank: counted on TP rank 0 only.
            if p.grad is not None and param_is_not_tensor_parallel_duplicate(p):
                squares += p.grad.detach().double().pow(2).sum()
        if self.tp_group.size() > 1:
            dist.all_reduce(squares, group=self.tp_group)
        return float(squares.sqrt())

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


class DistributedOptimizer(MegatronOptimizer):
    """Megatron's DDP + distributed optimizer (CUDA only)."""

    model: DistributedDataParallel  # syncs the gradients of the model it wraps

    def __init__(self, model: nn.Module, cfg: OptimConfig, bf16: bool, dp_size: int) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        super().__init__(cfg)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=True)
        self.model = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
        # Megatron's DDP averages gradients over data parallel; the losses are global shares.
        self.loss_scale = float(dp_size)
        self.optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=self.lr(), min_lr=0.0, weight_decay=cfg.weight_decay,
            adam_beta1=cfg.betas[0], adam_beta2=cfg.betas[1], adam_eps=cfg.eps,
            clip_grad=cfg.max_grad_norm or 0.0, bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32, use_distributed_optimizer=True),
            [self.model])

    def _apply_lr(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr()

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> tuple[float, bool]:
        self.model.finish_grad_sync()
        stepped, grad_norm, _ = self.optimizer.step()
        if stepped:
            self.steps += 1
            self._apply_lr()
        self.zero_grad()
        return float(grad_norm) if grad_norm is not None else float("nan"), bool(stepped)

    def state_dict(self) -> dict[str, Any]:
        # The Adam state and fp32 main weights are sharded over data parallel: each distributed
        # optimizer gathers its share to data-parallel rank 0 (collective).
        params = [o.get_parameter_state_dp_zero() for o in self.optimizer.chained_optimizers]
        return {"optimizer": self.optimizer.state_dict(), "parameters": params}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        for optimizer, params in zip(self.optimizer.chained_optimizers, state["parameters"], strict=True):
            optimizer.load_parameter_state_from_dp_zero(params)


def build_optimizer(model: nn.Module, cfg: OptimConfig, on_cuda: bool, distributed: bool, bf16: bool
                    ) -> MegatronOptimizer:
    from megatron.core import parallel_state

    if on_cuda and distributed:
        return DistributedOptimizer(model, cfg, bf16, parallel_state.get_data_parallel_world_size())
    return TorchAdamW(model, cfg, parallel_state.get_data_parallel_group(),
                      parallel_state.get_tensor_model_parallel_group())
