"""Resumable checkpoints of a training backend, at any world size.

The backend is a Stateful component (backend.py): it hands over its state as a dict and takes it
back, and this module only lays that state out in files and reads it again, so it never reaches
into a backend's privates (and imports no backend). Full (unsharded) state dicts are gathered to
rank 0 and written there; loading reads on rank 0 and the backend broadcasts. That keeps one file
layout for every world size (a run can resume on a different number of ranks) at the cost of rank 0
holding the full model and optimizer in CPU memory. For models that do not fit, switch to
torch.distributed.checkpoint's sharded save (same state-dict API).

Checkpoint layout:
    model.safetensors   the policy module (keys `lm.*`, `value_head.*`), fp32
    optimizer.pt        optimizer state keyed by parameter name
    trainer_state.pt    step, scheduler state
    rng/rank{r}.pt      each rank's RNG state
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rlfleet.trainer.backend import TrainingBackend


def save_checkpoint(backend: TrainingBackend, ckpt_dir: Path) -> None:
    state = backend.state_dict()
    if backend.rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        # Tied weights (embeddings = LM head) share storage, which safetensors refuses; each key gets
        # its own copy, and loading writes the same values into the one shared parameter.
        seen: set[int] = set()
        tensors = {}
        for k, v in state["model"].items():
            ptr = v.untyped_storage().data_ptr()
            tensors[k] = v.contiguous().clone() if ptr in seen else v.contiguous()
            seen.add(ptr)
        save_file(tensors, str(ckpt_dir / "model.safetensors"))
        torch.save(state["optimizer"], ckpt_dir / "optimizer.pt")
        torch.save(state["trainer"], ckpt_dir / "trainer_state.pt")
    backend.barrier()
    (ckpt_dir / "rng").mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), ckpt_dir / "rng" / f"rank{backend.rank}.pt")
    backend.barrier()


def load_checkpoint(backend: TrainingBackend, ckpt_dir: Path) -> None:
    if not (ckpt_dir / "trainer_state.pt").is_file():
        raise FileNotFoundError(f"no trainer checkpoint in {ckpt_dir}")
    model_state: dict = {}
    optim_state: dict = {}
    if backend.rank == 0:
        model_state = load_file(str(ckpt_dir / "model.safetensors"))
        optim_state = torch.load(ckpt_dir / "optimizer.pt", weights_only=True)
    trainer_state = torch.load(ckpt_dir / "trainer_state.pt", weights_only=False)
    backend.load_state_dict({"model": model_state, "optimizer": optim_state, "trainer": trainer_state})
    rng_file = ckpt_dir / "rng" / f"rank{backend.rank}.pt"
    if rng_file.is_file():
        # A resume on more ranks than were saved keeps the fresh RNG of the new ranks.
        set_rng_state(torch.load(rng_file, weights_only=False))
    backend.barrier()


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
