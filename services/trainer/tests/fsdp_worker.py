"""Run under torchrun by test_distributed.py: two RL steps, a checkpoint and an HF export at any world size.

Writes into argv[1]: logprobs.pt (before training), metrics.json, hf/ (after two steps), and at world
size >= 2 also hf_resumed/ (a fresh backend that loaded the step-1 checkpoint and took step 2).
"""

import json
import sys
from pathlib import Path

import torch

from rlfleet.trainer.batching import pack_batch
from rlfleet.trainer.config import BatchConfig, LossConfig, TorchBackendConfig
from rlfleet.trainer.objectives import rl_step
from rlfleet.trainer.testing import make_samples, tiny_qwen2_config
from rlfleet.trainer.torch_backend import TorchBackend

torch.set_num_threads(1)


def config(seed: int) -> TorchBackendConfig:
    # micro_batch_rows=1 and an odd number of rows: ranks run different micro-batch counts.
    return TorchBackendConfig(model_config_dict=tiny_qwen2_config(), seed=seed,
                              optim={"lr": 1e-3, "schedule": "cosine", "warmup_steps": 1, "total_steps": 4},
                              batch={"micro_batch_rows": 1, "pack_length": 40})


def main(out: Path) -> None:
    loss_cfg = LossConfig(loss_agg="seq_mean", tis_cap=2.0)
    batch_cfg = BatchConfig(pack_length=40, micro_batch_rows=1)
    first, second = make_samples(3, 4, lengths=(6, 30), seed=11), make_samples(3, 4, lengths=(6, 30), seed=12)
    b = TorchBackend(config(seed=0))
    logprobs = b.compute_logprobs(pack_batch(first, 40))
    metrics = [rl_step(b, first, loss_cfg, batch_cfg)]
    b.save_checkpoint(out / "ckpt")
    metrics.append(rl_step(b, second, loss_cfg, batch_cfg))
    b.save_hf(out / "hf")
    if b.world_size > 1:
        resumed = TorchBackend(config(seed=7))
        resumed.load_checkpoint(out / "ckpt")
        rl_step(resumed, second, loss_cfg, batch_cfg)
        resumed.save_hf(out / "hf_resumed")
    if b.rank == 0:
        torch.save(logprobs, out / "logprobs.pt")
        (out / "metrics.json").write_text(json.dumps({"world_size": b.world_size, "steps": metrics}))
    b.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
