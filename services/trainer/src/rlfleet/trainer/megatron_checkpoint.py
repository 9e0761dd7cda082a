"""HF export and resumable checkpoints of a MegatronBackend.

Checkpoint layout (the trainer's Checkpointer puts its own files beside these):
    megatron/tp{r}.pt            TP rank r's parameters (Megatron names, value head included, fp32) and
                                 its optimizer state: the backend's state_dict() of that shard
    trainer_state.pt             optimizer steps and LR schedule, the parallel layout it was saved at
    rng/rank{r}.pt               each rank's RNG state

Data-parallel replicas are identical, so data-parallel rank 0 of each TP rank writes. The files are
per TP shard, so a run resumes at the tensor-parallel size it was saved at (the data-parallel size
may change); a different TP size is refused with a clear error. `save_hf` (and every policy version
the trainer publishes) goes through the bridge's export instead, which is TP-independent.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from rlfleet.trainer.checkpoint import rng_state, set_rng_state
from rlfleet.trainer.torch_backend import TOKENIZER_FILES

if TYPE_CHECKING:
    from rlfleet.trainer.megatron_backend import MegatronBackend

STATE_FILE = "trainer_state.pt"


class CheckpointLayoutError(ValueError):
    """A checkpoint written at another tensor-parallel size, or by the other backend."""


def save_hf(backend: MegatronBackend, out_dir: Path) -> None:
    state = backend.state_dict_for_export()
    if backend.rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        config = backend.lm_config
        if not getattr(config, "architectures", None):
            config.architectures = [type(backend.policy.bridge.hf_pretrained.model).__name__]
        config.dtype = "float32"
        config.save_pretrained(out_dir)
        save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        assert backend.cfg.model_dir is not None  # the backend refuses to start without one
        for name in TOKENIZER_FILES:
            source = Path(backend.cfg.model_dir) / name
            if source.is_file():
                shutil.copyfile(source, out_dir / name)
    backend.barrier()


def _shard_file(ckpt_dir: Path) -> Path:
    from megatron.core import parallel_state

    return ckpt_dir / "megatron" / f"tp{parallel_state.get_tensor_model_parallel_rank()}.pt"


def save_checkpoint(backend: MegatronBackend, ckpt_dir: Path) -> None:
    state = backend.state_dict()  # collective
    shard = _shard_file(ckpt_dir)
    if backend.dp_rank == 0:
        shard.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": state["model"], "optimizer": state["optimizer"]}, shard)
    if backend.rank == 0:
        torch.save(state["trainer"], ckpt_dir / STATE_FILE)
    (ckpt_dir / "rng").mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), ckpt_dir / "rng" / f"rank{backend.rank}.pt")
    backend.barrier()


def load_checkpoint(backend: MegatronBackend, ckpt_dir: Path) -> None:
    if not (ckpt_dir / STATE_FILE).is_file():
        raise FileNotFoundError(f"no trainer checkpoint in {ckpt_dir}")
    trainer = torch.load(ckpt_dir / STATE_FILE, weights_only=False)
    check_layout(trainer, backend.tp_size, ckpt_dir)
    shard = torch.load(_shard_file(ckpt_dir), weights_only=False)
    backend.load_state_dict({**shard, "trainer": trainer})
    rng_file = ckpt_dir / "rng" / f"rank{backend.rank}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    backend.barrier()


def check_layout(trainer: dict, tp_size: int, where: Path | str) -> None:
    if trainer.get("backend") != "megatron":
        raise CheckpointLayoutError(f"{where} was written by the torch backend; set "
                                    "backend.name = \"torch\" to resume it (or start a new run)")
    if trainer["tensor_parallel"] != tp_size:
        raise CheckpointLayoutError(f"{where} was saved at tensor parallel {trainer['tensor_parallel']}; "
                                    f"this trainer runs {tp_size}: resume with the same "
                                    "megatron.tensor_parallel")
