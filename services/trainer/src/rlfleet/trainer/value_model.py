"""PPO's critic as a model of its own: its own weights, optimizer, LR schedule and checkpoint.

verl, OpenRLHF and slime train a separate value model beside the policy; `critic = "shared"` (a
linear head on the policy's trunk, trained inside the policy's loss) stays as the other choice. The
critic is a Stateful component like the policy backend: the trainer's checkpoints carry it in a
subdirectory (VALUE_MODEL_DIR) of the same checkpoint, so the exactly-once guarantees cover it.

Every method is collective under torchrun, like the backend's.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any

import torch

from rlfleet.trainer.backend import ModelOutputs
from rlfleet.trainer.batching import TrainBatch
from rlfleet.trainer.config import LossConfig, TorchBackendConfig
from rlfleet.trainer.losses import LossNorm, Metrics, value_loss

VALUE_MODEL_DIR = "value_model"
# The value loss terms keep their names; the critic's step bookkeeping is prefixed.
VALUE_METRICS = ("value_loss", "value_clip_frac", "value_mean")


class ValueModel(abc.ABC):
    """V(s_t) for every position of a batch (aligned like ModelOutputs.values: position t holds the
    value of the state before token t), and one optimizer step on the clipped value loss."""

    @abc.abstractmethod
    def values(self, batch: TrainBatch) -> torch.Tensor:
        """[rows, length] values without grad, on CPU, identical on every rank."""

    @abc.abstractmethod
    def train_step(self, batch: TrainBatch, cfg: LossConfig) -> Metrics:
        """One optimizer step towards `batch.returns` (clipped around `batch.old_values`)."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    def save_checkpoint(self, ckpt_dir: str | Path) -> None: ...

    @abc.abstractmethod
    def load_checkpoint(self, ckpt_dir: str | Path) -> None: ...

    def close(self) -> None:
        """Releases what the critic holds."""


class ValueObjective:
    """The clipped value loss as a backend LossFn."""

    needs_values = True
    needs_entropy_grad = False

    def __init__(self, cfg: LossConfig) -> None:
        self.cfg = cfg

    def __call__(self, out: ModelOutputs, batch: TrainBatch, norm: LossNorm) -> tuple[torch.Tensor, Metrics]:
        if batch.returns is None or batch.old_values is None:
            raise ValueError("the value loss needs returns and old_values; call with_advantages first")
        assert out.values is not None  # needs_values: the backend ran the value head
        loss, metrics = value_loss(out.values, batch.old_values, batch.returns,
                                   batch.loss_mask, batch.seq_ids, self.cfg, norm)
        return loss, {"loss": metrics["value_loss"], **metrics}


class TorchValueModel(ValueModel):
    """A transformers trunk with a scalar head (no LM head run), on the torch backend (FSDP2 under
    torchrun), so it shards, steps and checkpoints exactly as the policy does. The head starts at
    zero (V = 0: the first advantages are the plain returns)."""

    def __init__(self, cfg: TorchBackendConfig) -> None:
        from rlfleet.trainer.torch_backend import TorchBackend

        self.backend = TorchBackend(cfg.model_copy(update={"value_head": True, "values_only": True}))

    @property
    def step(self) -> int:
        return self.backend.step

    def values(self, batch: TrainBatch) -> torch.Tensor:
        return self.backend.compute_values(batch)

    def train_step(self, batch: TrainBatch, cfg: LossConfig) -> Metrics:
        metrics = self.backend.train_step(batch, ValueObjective(cfg))
        metrics.pop("loss", None)  # the same number as value_loss
        return {k if k in VALUE_METRICS else f"critic_{k}": v for k, v in metrics.items()}

    def state_dict(self) -> dict[str, Any]:
        return self.backend.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.backend.load_state_dict(state)

    def save_checkpoint(self, ckpt_dir: str | Path) -> None:
        self.backend.save_checkpoint(ckpt_dir)

    def load_checkpoint(self, ckpt_dir: str | Path) -> None:
        self.backend.load_checkpoint(ckpt_dir)

    def close(self) -> None:
        self.backend.close()
