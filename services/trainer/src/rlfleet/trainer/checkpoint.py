"""HF export and resumable checkpoints of a TorchBackend, at any world size.

Full (unsharded) state dicts are gathered to rank 0 and written there; loading reads on rank 0 and
broadcasts. That keeps one file layout for every world size (a run can resume on a different number
of ranks) at the cost of rank 0 holding the full model and optimizer in CPU memory. For models that
do not fit, switch to torch.distributed.checkpoint's sharded save (same state-dict API).

Checkpoint layout:
    model.safetensors   the policy module (keys `lm.*`, `value_head.*`), fp32
    optimizer.pt        AdamW state keyed by parameter name
    trainer_state.pt    step, scheduler state
    rng/rank{r}.pt      each rank's RNG state
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

if TYPE_CHECKING:
    from rlfleet.trainer.torch_backend import TorchBackend

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json")
LM_PREFIX = "lm."


def _full_options() -> StateDictOptions:
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def export_state_dict(backend: TorchBackend) -> dict[str, torch.Tensor]:
    """HF names (`model.layers.0...`, `lm_head.weight`), no value head; full tensors on rank 0 only."""
    full = get_model_state_dict(backend.model, options=_full_options())
    if backend.rank != 0:
        return {}
    out = {k[len(LM_PREFIX):]: v.detach().to("cpu").contiguous().clone()
           for k, v in full.items() if k.startswith(LM_PREFIX)}
    if getattr(backend.lm_config, "tie_word_embeddings", False):
        # Tied heads are stored once, as HF does; transformers re-ties on load.
        out.pop("lm_head.weight", None)
    return out


def save_hf(backend: TorchBackend, out_dir: Path) -> None:
    state = export_state_dict(backend)
    if backend.rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        config = backend.lm_config
        if not getattr(config, "architectures", None):
            # Engines (SGLang, vLLM) pick the model class from `architectures`; a model built from a
            # config has none until transformers' own save_pretrained would fill it in.
            config.architectures = [type(backend.model.lm).__name__]
        config.dtype = "float32"
        config.save_pretrained(out_dir)
        save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        source = backend.cfg.model_dir
        for name in TOKENIZER_FILES:
            if source is not None and (Path(source) / name).is_file():
                shutil.copyfile(Path(source) / name, out_dir / name)
    backend.barrier()


def save_checkpoint(backend: TorchBackend, ckpt_dir: Path) -> None:
    model_state, optim_state = get_state_dict(backend.model, backend.optimizer, options=_full_options())
    if backend.rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        # Tied weights (embeddings = LM head) share storage, which safetensors refuses; each key gets
        # its own copy, and loading writes the same values into the one shared parameter.
        seen: set[int] = set()
        tensors = {}
        for k, v in model_state.items():
            ptr = v.untyped_storage().data_ptr()
            tensors[k] = v.contiguous().clone() if ptr in seen else v.contiguous()
            seen.add(ptr)
        save_file(tensors, str(ckpt_dir / "model.safetensors"))
        torch.save(optim_state, ckpt_dir / "optimizer.pt")
        torch.save({"step": backend.step, "scheduler": backend.scheduler.state_dict()}, ckpt_dir / "trainer_state.pt")
    backend.barrier()
    from rlfleet.trainer.torch_backend import rng_state

    (ckpt_dir / "rng").mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), ckpt_dir / "rng" / f"rank{backend.rank}.pt")
    backend.barrier()


def load_checkpoint(backend: TorchBackend, ckpt_dir: Path) -> None:
    if not (ckpt_dir / "trainer_state.pt").is_file():
        raise FileNotFoundError(f"no trainer checkpoint in {ckpt_dir}")
    model_state: dict = {}
    optim_state: dict = {}
    if backend.rank == 0:
        model_state = load_file(str(ckpt_dir / "model.safetensors"))
        optim_state = torch.load(ckpt_dir / "optimizer.pt", weights_only=True)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=backend.world_size > 1)
    # Two calls, not set_state_dict: that one treats an empty model dict (every rank but 0 when
    # broadcasting) as "optimizer only" and the ranks' collectives stop matching (torch 2.13).
    set_model_state_dict(backend.model, model_state, options=options)
    set_optimizer_state_dict(backend.model, backend.optimizer, optim_state, options=options)
    state = torch.load(ckpt_dir / "trainer_state.pt", weights_only=False)
    backend.scheduler.load_state_dict(state["scheduler"])
    backend._step = int(state["step"])
    rng_file = ckpt_dir / "rng" / f"rank{backend.rank}.pt"
    if rng_file.is_file():
        # A resume on more ranks than were saved keeps the fresh RNG of the new ranks.
        from rlfleet.trainer.torch_backend import set_rng_state

        set_rng_state(torch.load(rng_file, weights_only=False))
    backend.barrier()
