"""Run under torchrun by test_megatron_backend.py: the Megatron backend at one TP size, for each objective.

    torchrun ... megatron_worker.py MODEL_DIR TP OUT_DIR:OBJECTIVE [OUT_DIR:OBJECTIVE ...]

For each objective, on the batches of `steps()`: the log-probs before training, the HF export right
after conversion (round trip), two RL steps with a checkpoint after the first, the export after
them, and a fresh backend that loads the checkpoint and retakes step 2 (resume). Rank 0 writes
everything to that objective's OUT_DIR. The objectives run one after the other in one process
group (a torchrun and Megatron's imports per objective cost more than the objective's run); each
builds its backends, and with them Megatron's parallel state, anew.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlfleet.trainer.batching import pack_batch
from rlfleet.trainer.config import BatchConfig, LossConfig, MegatronConfig, TorchBackendConfig
from rlfleet.trainer.megatron_backend import MegatronBackend
from rlfleet.trainer.objectives import SFTObjective, rl_step
from rlfleet.trainer.testing import make_samples

torch.set_num_threads(1)
PACK = 40


def backend_config(model_dir: str, algorithm: str, seed: int = 0) -> TorchBackendConfig:
    return TorchBackendConfig(model_dir=model_dir, seed=seed, value_head=algorithm == "ppo",
                              optim={"lr": 1e-3, "schedule": "cosine", "warmup_steps": 1, "total_steps": 4},
                              batch={"micro_batch_rows": 1, "pack_length": PACK})


def steps() -> list:
    return [make_samples(3, 4, lengths=(6, 30), vocab_size=320, seed=11),
            make_samples(3, 4, lengths=(6, 30), vocab_size=320, seed=12)]


def loss_config(algorithm: str) -> LossConfig:
    """"grpo+kl": GRPO with a k3 KL penalty to a frozen reference copy of the starting model."""
    name, _, kl = algorithm.partition("+")
    return LossConfig(algorithm=name, loss_agg="seq_mean", tis_cap=2.0, kl_coef=0.5 if kl else 0.0,
                      critic="shared")  # Megatron's PPO: a value head on the policy's trunk



def train(backend, samples: list, algorithm: str, reference=None) -> dict:
    """One optimizer step: the RL loop's (rl_step) or SFT's (train_step with SFTObjective)."""
    if algorithm == "sft":
        return backend.train_step(pack_batch(samples, PACK), SFTObjective())
    batch_cfg = BatchConfig(pack_length=PACK, micro_batch_rows=1)
    return rl_step(backend, samples, loss_config(algorithm), batch_cfg, reference=reference)


def main(out: Path, model_dir: str, tp: int, algorithm: str) -> None:
    parallel = MegatronConfig(tensor_parallel=tp)
    first, second = steps()
    b = MegatronBackend(backend_config(model_dir, algorithm), parallel)
    reference = MegatronBackend(backend_config(model_dir, algorithm), parallel, trainable=False) \
        if "+kl" in algorithm else None
    converted = b.state_dict_for_export()
    logprobs = b.compute_logprobs(pack_batch(first, PACK))
    metrics = [train(b, first, algorithm, reference)]
    b.save_checkpoint(out / "ckpt")
    metrics.append(train(b, second, algorithm, reference))
    trained = b.state_dict_for_export()
    b.save_hf(out / "hf")
    resumed = MegatronBackend(backend_config(model_dir, algorithm, seed=7), parallel)
    resumed.load_checkpoint(out / "ckpt")
    train(resumed, second, algorithm, reference)
    again = resumed.state_dict_for_export()
    if b.rank == 0:
        save_file(converted, str(out / "converted.safetensors"))
        save_file(trained, str(out / "trained.safetensors"))
        save_file(again, str(out / "resumed.safetensors"))
        torch.save(logprobs, out / "logprobs.pt")
        (out / "metrics.json").write_text(json.dumps({"world_size": b.world_size, "tp": b.tp_size,
                                                      "dp": b.dp_size, "steps": metrics}))
    resumed.close()
    b.close()


if __name__ == "__main__":
    model, tp, cases = sys.argv[1], int(sys.argv[2]), [case.rpartition(":") for case in sys.argv[3:]]
    # Joined here, so that no backend owns the group and closing one leaves it for the next.
    torch.distributed.init_process_group("gloo")
    for out, _, algorithm in cases:
        main(Path(out), model, tp, algorithm)
    torch.distributed.destroy_process_group()
