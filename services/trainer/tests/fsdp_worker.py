"""Run under torchrun by test_distributed.py: two RL steps, a checkpoint and an HF export at any world size.

Writes into argv[1]: logprobs.pt (before training), metrics.json, hf/ (after two steps), and at world
size >= 2 also hf_resumed/ (a fresh backend that loaded the step-1 checkpoint and took step 2).
With argv[2] = "ppo": PPO with a separate critic, whose weights after the two steps (and after the
resumed step 2) are written as critic.safetensors (critic_resumed.safetensors).
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from rlfleet.trainer.batching import pack_batch
from rlfleet.trainer.config import BatchConfig, LossConfig, TorchBackendConfig
from rlfleet.trainer.objectives import rl_step
from rlfleet.trainer.testing import make_samples, tiny_qwen2_config
from rlfleet.trainer.torch_backend import TorchBackend
from rlfleet.trainer.value_model import TorchValueModel

torch.set_num_threads(1)


def config(seed: int) -> TorchBackendConfig:
    # micro_batch_rows=1 and an odd number of rows: ranks run different micro-batch counts.
    return TorchBackendConfig(model_config_dict=tiny_qwen2_config(), seed=seed,
                              optim={"lr": 1e-3, "schedule": "cosine", "warmup_steps": 1, "total_steps": 4},
                              batch={"micro_batch_rows": 1, "pack_length": 40})


def critic_weights(critic: TorchValueModel | None, path: Path) -> None:
    if critic is None:
        return
    state = critic.state_dict()["model"]
    if critic.backend.rank == 0:
        save_file({k: v.contiguous().clone() for k, v in state.items()}, str(path))


def main(out: Path, algorithm: str) -> None:
    ppo = algorithm == "ppo"
    loss_cfg = LossConfig(algorithm=algorithm, loss_agg="seq_mean", tis_cap=2.0)
    batch_cfg = BatchConfig(pack_length=40, micro_batch_rows=1)
    first, second = make_samples(3, 4, lengths=(6, 30), seed=11), make_samples(3, 4, lengths=(6, 30), seed=12)
    b = TorchBackend(config(seed=0))
    critic = TorchValueModel(config(seed=0)) if ppo else None
    logprobs = b.compute_logprobs(pack_batch(first, 40))
    metrics = [rl_step(b, first, loss_cfg, batch_cfg, value_model=critic)]
    b.save_checkpoint(out / "ckpt")
    if critic is not None:
        critic.save_checkpoint(out / "ckpt" / "value_model")
    metrics.append(rl_step(b, second, loss_cfg, batch_cfg, value_model=critic))
    b.save_hf(out / "hf")
    critic_weights(critic, out / "critic.safetensors")
    if b.world_size > 1:
        resumed = TorchBackend(config(seed=7))
        resumed_critic = TorchValueModel(config(seed=7)) if ppo else None
        resumed.load_checkpoint(out / "ckpt")
        if resumed_critic is not None:
            resumed_critic.load_checkpoint(out / "ckpt" / "value_model")
        rl_step(resumed, second, loss_cfg, batch_cfg, value_model=resumed_critic)
        resumed.save_hf(out / "hf_resumed")
        critic_weights(resumed_critic, out / "critic_resumed.safetensors")
    if b.rank == 0:
        torch.save(logprobs, out / "logprobs.pt")
        (out / "metrics.json").write_text(json.dumps({"world_size": b.world_size, "steps": metrics}))
    if b.world_size > 1:
        # Tearing gloo down at exit could abort a rank in C++ ("terminate called without an active
        # exception": a joinable thread destroyed), rarely, under load, after its outputs were written.
        # Both ranks leave together, and without C++ teardown: the process group dies with the process.
        dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    b.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "grpo")
