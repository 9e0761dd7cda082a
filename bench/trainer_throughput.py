"""Trainer throughput on CPU: trained tokens/s of the torch backend at world size 1 and 2 (torchrun,
gloo, FSDP2) beside the Megatron-core backend at tensor parallel 1 and 2 (torchrun, gloo), on the
same HF model and batches; and padded vs packed batch layouts. Prints figures; not a pass/fail test.

    .venv/bin/python bench/trainer_throughput.py            # everything
    .venv/bin/python bench/trainer_throughput.py --skip-dist  # layouts only
    .venv/bin/python bench/trainer_throughput.py --skip-layouts --steps 2  # backends side by side

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
             num_key_value_heads=2, intermediate_size=704, max_position_embeddings=4096,
             tie_word_embeddings=False)


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


def backend(layout: str, pack_length: int | None, micro_batch_rows: int, model_dir: str | None = None,
            megatron_tp: int = 0):
    """The torch backend (FSDP2 under torchrun), or the Megatron one at TP `megatron_tp` (needs model_dir)."""
    from rlfleet.trainer.config import MegatronConfig, TorchBackendConfig

    source = {"model_dir": model_dir} if model_dir else {"model_config_dict": MODEL}
    batch = {"layout": layout, "pack_length": pack_length, "micro_batch_rows": micro_batch_rows}
    cfg = TorchBackendConfig(**source, optim={"lr": 1e-5}, batch=batch)
    if megatron_tp:
        from rlfleet.trainer.megatron_backend import MegatronBackend

        return MegatronBackend(cfg, MegatronConfig(tensor_parallel=megatron_tp))
    from rlfleet.trainer.torch_backend import TorchBackend

    return TorchBackend(cfg)


def write_model(out_dir: Path) -> Path:
    """MODEL as an HF directory, so that both backends start from the same weights."""
    import torch
    import transformers

    params = dict(MODEL)
    config = transformers.AutoConfig.for_model(params.pop("model_type"), **params)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out_dir)
    return out_dir


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


def worker(steps: int, model_dir: str, megatron_tp: int) -> None:
    """One rank of the world-size benchmark; rank 0 prints a JSON line."""
    import torch

    torch.set_num_threads(1)
    data = samples(32, (150, 250))
    b = backend("packed", None, micro_batch_rows=2, model_dir=model_dir, megatron_tp=megatron_tp)
    times = timed_steps(b, data, "packed", None, steps)
    tokens = sum(len(s.token_ids) for s in data)
    if b.rank == 0:
        median = statistics.median(times)
        print(json.dumps({"world_size": b.world_size, "tokens": tokens, "step_s": median,
                          "tokens_per_s": tokens / median}), flush=True)
    b.close()


def world_size_bench(steps: int) -> None:
    """FSDP2 at world size 1 and 2, Megatron at TP 1 and 2: one model, one batch, one thread per rank."""
    import tempfile

    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp) / "model")
        for label, nproc, tp in (("FSDP2 world size 1", 1, 0), ("FSDP2 world size 2", 2, 0),
                                 ("Megatron TP 1     ", 1, 1), ("Megatron TP 2     ", 2, 2)):
            cmd = [str(torchrun), "--standalone", f"--nproc-per-node={nproc}", __file__, "--worker",
                   "--steps", str(steps), "--model-dir", str(model_dir), "--megatron-tp", str(tp)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            if proc.returncode != 0 or not lines:
                print(f"{label}: failed\n{proc.stderr[-2000:]}")
                continue
            r = json.loads(lines[-1])
            print(f"{label}: {r['tokens_per_s']:8.0f} trained tokens/s ({r['tokens']} tokens in "
                  f"{r['step_s']:.2f} s per step, GRPO, packed, {nproc} process(es))")


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
        print(f"  {label:12s} rows x length {shape!s:12s} {median * 1000:7.0f} ms/step  "
              f"{tokens / median:7.0f} tokens/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    parser.add_argument("--skip-dist", action="store_true", help="only the layout comparison")
    parser.add_argument("--skip-layouts", action="store_true", help="only the world-size comparison")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--megatron-tp", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.model_dir, args.megatron_tp)
        return
    if not args.skip_layouts:
        layout_bench(args.steps)
    if not args.skip_dist:
        world_size_bench(args.steps)


if __name__ == "__main__":
    main()
