"""The training-backend contract: what the trainer loop needs from a model + optimizer stack.

The torch/FSDP2 backend (torch_backend.py) is the default; a Megatron-core backend implements the
same methods. Every method is collective: in a multi-rank job all ranks call it with the same
arguments (the same global batch), each rank works on its own shard, and results that the loop
reads (outputs, metrics) are identical on every rank. Files are written by rank 0 only.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from rlfleet.trainer.batching import TrainBatch
from rlfleet.trainer.losses import LossNorm, Metrics


@dataclass
class ModelOutputs:
    """Aligned per-token model outputs (see batching.py): position t is about token t."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None


class LossFn(Protocol):
    """Maps one micro-batch's outputs to its share of the global loss (normalised by `norm`)."""

    # Optional class attributes read by backends (default False): run the value head; keep the
    # entropy's graph (only needed when the loss differentiates through it).
    needs_values: bool
    needs_entropy_grad: bool

    # Positional-only: backends pass the three in order, so a loss may name them as it likes.
    def __call__(self, outputs: ModelOutputs, batch: TrainBatch, norm: LossNorm, /,
                 ) -> tuple[torch.Tensor, Metrics]: ...


class Stateful(Protocol):
    """What a checkpointer saves and restores (torchtitan's Stateful): a component hands its state
    over as a dict and takes it back, so the checkpointer never reaches into its privates."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class TrainingBackend(abc.ABC):
    """A Stateful component: `state_dict()` holds `model` and `optimizer` (full, unsharded, on
    rank 0) and `trainer` (`step` and the LR `scheduler`); checkpoint.py writes and reads them."""

    rank: int = 0
    world_size: int = 1

    @property
    @abc.abstractmethod
    def step(self) -> int:
        """Optimizer steps taken (restored by load_checkpoint)."""

    @abc.abstractmethod
    def forward_inference(self, batch: TrainBatch, with_values: bool = False) -> ModelOutputs:
        """Log-probs (and entropy, values) of the whole batch without grad, on every rank."""

    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self.forward_inference(batch).logprobs

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """The value head's values of the whole batch without grad; a backend may skip the LM head."""
        values = self.forward_inference(batch, with_values=True).values
        if values is None:
            raise ValueError("the backend has no value head (set value_head=true)")
        return values

    @abc.abstractmethod
    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> Metrics:
        """One optimizer step on the global batch, accumulating gradients over micro-batches."""

    @abc.abstractmethod
    def state_dict_for_export(self) -> dict[str, torch.Tensor]:
        """The policy's full HF-named state dict on CPU, on rank 0 (empty elsewhere); no value head."""

    @abc.abstractmethod
    def save_hf(self, out_dir: str | Path) -> None:
        """config.json + model.safetensors (+ tokenizer files of the source) that transformers
        and the engine load."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Stateful: {"model", "optimizer", "trainer": {"step", "scheduler"}}; collective."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Stateful: restores what `state_dict` gave (the model and optimizer read on rank 0 are
        broadcast to the other ranks); collective."""

    def base_state_for_export(self) -> dict[str, torch.Tensor]:
        """LoRA: the frozen base weights, HF-named (what every adapter version applies to); rank 0 only."""
        raise NotImplementedError(f"{type(self).__name__} trains no LoRA adapter")

    def adapter_for_export(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """LoRA: the adapter's tensors under peft's file names and its adapter_config.json; rank 0 only."""
        raise NotImplementedError(f"{type(self).__name__} trains no LoRA adapter")

    @abc.abstractmethod
    def save_checkpoint(self, ckpt_dir: str | Path) -> None:
        """Weights, optimizer, scheduler, RNG and step: everything needed to continue bit-for-bit."""

    @abc.abstractmethod
    def load_checkpoint(self, ckpt_dir: str | Path) -> None: ...

    def barrier(self) -> None:
        """Waits for every rank (a no-op on one)."""

    @abc.abstractmethod
    def set_lr(self, lr: float) -> None:
        """Sets the peak LR; the schedule keeps its shape from the current step."""

    def close(self) -> None:
        """Releases process groups and other resources."""


class MetricReducer:
    """Combines per-micro-batch metrics: loss terms add up (they are already global shares),
    `*_max` take the maximum, everything else is a mean weighted by loss tokens."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.maxima: dict[str, float] = {}

    @staticmethod
    def _is_sum(key: str) -> bool:
        return key == "loss" or key.endswith("_loss")

    def add(self, metrics: Metrics, weight: float) -> None:
        for key, value in metrics.items():
            if key.endswith("_max"):
                self.maxima[key] = max(self.maxima.get(key, float("-inf")), value)
            elif self._is_sum(key):
                self.sums[key] = self.sums.get(key, 0.0) + value
            else:
                self.sums[key] = self.sums.get(key, 0.0) + value * weight
                self.weights[key] = self.weights.get(key, 0.0) + weight

    @staticmethod
    def combine(reducers: Iterable[MetricReducer]) -> MetricReducer:
        out = MetricReducer()
        for other in reducers:
            for key, value in other.sums.items():
                out.sums[key] = out.sums.get(key, 0.0) + value
            for key, value in other.weights.items():
                out.weights[key] = out.weights.get(key, 0.0) + value
            for key, value in other.maxima.items():
                out.maxima[key] = max(out.maxima.get(key, float("-inf")), value)
        return out

    def result(self) -> Metrics:
        out = {k: v if self._is_sum(k) else v / max(self.weights.get(k, 0.0), 1e-12)
               for k, v in self.sums.items()}
        out.update(self.maxima)
        return out
