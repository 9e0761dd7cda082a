"""Trainer throughput on CPU: trained tokens/s at world size 1 and 2 (torchrun, gloo, FSDP2), and
padded vs packed batch layouts. Prints figures; it is not a pass/fail test.

    .venv/bin/python bench/trainer_throughput.py            # everything
    .venv/bin/python bench/trainer_throughput.py --skip-dist  # layouts only

Model: Qwen2, hidden 256, 4 layers, vocab 1024 (~3.5M parameters). Batch: 32 sequences of
150-250 tokens (GRPO, groups of 8). Each process uses one thread (OMP_NUM_THREADS=1), so world
size 2 uses twice the cores of world size 1.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODEL = dict(model_type="qwen2", vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=704, max_position_embeddings=4096, tie_word_embeddings=False)


def samples(n: int, lengths: tuple[int, int], seed: int = 0):
    from rlfleet.trainer.batching import TrainSample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(*lengths)
        prompt = max(length // 4, 1)
        mask = [0] * prompt + [1] * (length - prompt)
        out.append(TrainSample(f"t{i}", f"g{i // 8}", [rng.randrange(3, 1024) for _ in range(length)],
                               [-1.0 * m for m in mask], mask, float(i % 2)))
    return out


def backend(layout: str, pack_length: int | None, micro_batch_rows: int):
    from rlfleet.trainer.config import TorchBackendConfig
    from rlfleet.trainer.torch_backend import TorchBackend

    return TorchBackend(TorchBackendConfig(model_config_dict=MODEL, optim={"lr": 1e-5},
                                           batch={"layout": layout, "pack_length": pack_length,
                                                  "micro_batch_rows": micro_batch_rows}))


def timed_steps(b, batch_samples, layout: str, pack_length: int | None, steps: int) -> list[float]:
    from rlfleet.trainer.config import BatchConfig, LossConfig
    from rlfleet.trainer.objectives import rl_step

    cfg = BatchConfig(layout=layout, pack_length=pack_length, micro_batch_rows=b.cfg.batch.micro_batch_rows)
    times = []
    for _ in range(steps + 1):  # the first step warms up allocators and kernels
        start = time.perf_counter()
        rl_step(b, batch_samples, LossConfig(), cfg, recompute_old_logprobs=False)
        times.append(time.perf_counter() - start)
    return times[1:]


def worker(steps: int) -> None:
    """One rank of the world-size benchmark; rank 0 prints a JSON line."""
    import torch

    torch.set_num_threads(1)
    data = samples(32, (150, 250))
    b = backend("packed", None, micro_batch_rows=2)
    times = timed_steps(b, data, "packed", None, steps)
    tokens = sum(len(s.token_ids) for s in data)
    if b.rank == 0:
        median = statistics.median(times)
        print(json.dumps({"world_size": b.world_size, "tokens": tokens, "step_s": median,
                          "tokens_per_s": tokens / median}), flush=True)
    b.close()


def world_size_bench(steps: int) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for nproc in (1, 2):
        proc = subprocess.run([str(torchrun), "--standalone", f"--nproc-per-node={nproc}", __file__, "--worker",
                               "--steps", str(steps)], env=env, capture_output=True, text=True, timeout=600)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            print(f"world size {nproc}: failed\n{proc.stderr[-2000:]}")
            continue
        r = json.loads(lines[-1])
        print(f"world size {r['world_size']}: {r['tokens_per_s']:8.0f} trained tokens/s "
              f"({r['tokens']} tokens in {r['step_s']:.2f} s per step, GRPO, packed)")


def layout_bench(steps: int) -> None:
    """16 sequences of 40-200 tokens, one micro-batch each way: forward + backward + AdamW."""
    import torch

    torch.set_num_threads(1)
    data = samples(16, (40, 200), seed=1)
    tokens = sum(len(s.token_ids) for s in data)
    print(f"layouts: 16 sequences, {tokens} tokens (lengths 40-200), one micro-batch, 1 thread")
    for layout, pack_length in (("padded", None), ("packed", None), ("packed", 512), ("packed", 2048)):
        from rlfleet.trainer.batching import assemble_batch

        b = backend(layout, pack_length, micro_batch_rows=16)
        shape = tuple(assemble_batch(data, layout, pack_length).input_ids.shape)
        median = statistics.median(timed_steps(b, data, layout, pack_length, steps))
        label = layout if layout == "padded" else f"packed {pack_length or 'auto'}"
        print(f"  {label:12s} rows x length {shape!s:12s} {median * 1000:7.0f} ms/step  {tokens / median:7.0f} tokens/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    parser.add_argument("--skip-dist", action="store_true", help="only the layout comparison")
    parser.add_argument("--skip-layouts", action="store_true", help="only the world-size comparison")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps)
        return
    if not args.skip_layouts:
        layout_bench(args.steps)
    if not args.skip_dist:
        world_size_bench(args.steps)


if __name__ == "__main__":
    main()
