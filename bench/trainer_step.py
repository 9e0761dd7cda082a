"""One trainer step of the RL loop, side by side: padded vs packed batches at 1 and 2 torch threads,
packed in fp32 vs bf16 autocast, and PPO's pre-update pass with and without the LM head. Prints
figures; not a pass/fail test.

    .venv/bin/python bench/trainer_step.py                 # 5 timed rounds
    .venv/bin/python bench/trainer_step.py --rounds 3 --groups 4

Model: the `rlfleet run` default shape (Qwen2, hidden 256, 4 layers) with a vocabulary of 1024.
Batch: `groups` groups of 8 trajectories (the calc example's 8 per step), lengths uniform in
--lengths, a quarter prompt; GRPO, micro_batch_rows 4 (the default). The configurations are timed
in interleaved rounds (one step of each per round, after a warm-up step each), so that a machine
whose load moves during the run moves every column alike; the figure is the median. The layout
columns are fp32; the bf16 columns (packed, `backend.bf16`: autocast, fp32 weights and optimizer, the
attention in fp32 on the CPU, rlfleet.trainer.attention) are what `rlfleet run` trains with.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

MODEL = dict(model_type="qwen2", vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=704, max_position_embeddings=4096,
             tie_word_embeddings=False)


def samples(groups: int, lengths: tuple[int, int], seed: int = 0):
    from rlfleet.trainer.batching import TrainSample

    rng = random.Random(seed)
    out = []
    for g in range(groups):
        for k in range(8):
            n = rng.randint(*lengths)
            prompt = max(n // 4, 1)
            mask = [0] * prompt + [1] * (n - prompt)
            out.append(TrainSample(f"t{g}-{k}", f"g{g}", [rng.randrange(3, 1024) for _ in range(n)],
                                   [-1.0 * m for m in mask], mask, float(k % 2)))
    return out


def backend(layout: str, value_head: bool = False, bf16: bool = False):
    from rlfleet.trainer.config import TorchBackendConfig
    from rlfleet.trainer.torch_backend import TorchBackend

    return TorchBackend(TorchBackendConfig(model_config_dict=MODEL, value_head=value_head, optim={"lr": 1e-5},
                                           batch={"layout": layout}, bf16=bf16))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up round)")
    parser.add_argument("--groups", type=int, default=8, help="groups of 8 trajectories per step")
    parser.add_argument("--lengths", default="40,200", help="min,max tokens per trajectory")
    parser.add_argument("--threads", default="1,2", help="torch thread counts to compare")
    args = parser.parse_args()

    import torch

    from rlfleet.trainer.batching import assemble_batch
    from rlfleet.trainer.config import BatchConfig, LossConfig
    from rlfleet.trainer.objectives import rl_step

    lo, hi = (int(x) for x in args.lengths.split(","))
    data = samples(args.groups, (lo, hi))
    tokens = sum(len(s.token_ids) for s in data)
    threads = [int(t) for t in args.threads.split(",")]
    backends = {name: backend(name) for name in ("padded", "packed")}
    backends["packed bf16"] = backend("packed", bf16=True)
    columns = [(name, t) for name in backends for t in threads]
    times: dict[tuple[str, int], list[float]] = {c: [] for c in columns}
    for r in range(args.rounds + 1):
        for name, t in columns:
            torch.set_num_threads(t)
            start = time.perf_counter()
            layout = name.split()[0]
            rl_step(backends[name], data, LossConfig(), BatchConfig(layout=layout))
            if r:  # round 0 warms up allocators and kernels
                times[(name, t)].append(time.perf_counter() - start)

    # PPO (shared critic): the values before the update, with the LM head and softmax (as the pass used
    # to run, log-probs that the training pass gives anyway) and without.
    ppo = backend("packed", value_head=True)
    batch = assemble_batch(data, "packed")
    pre: dict[str, list[float]] = {"full forward": [], "values only": []}
    torch.set_num_threads(threads[0])
    for r in range(args.rounds + 1):
        for label, fn in (("full forward", lambda: ppo.forward_inference(batch, with_values=True)),
                          ("values only", lambda: ppo.compute_values(batch))):
            start = time.perf_counter()
            fn()
            if r:
                pre[label].append(time.perf_counter() - start)

    shapes = {layout: tuple(assemble_batch(data, layout).input_ids.shape) for layout in ("padded", "packed")}
    print(f"trainer step: {len(data)} trajectories, {tokens} tokens (lengths {lo}-{hi}), GRPO, "
          f"micro_batch_rows 4; median of {args.rounds} interleaved rounds; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for name, t in columns:
        median = statistics.median(times[(name, t)])
        shape = shapes[name.split()[0]]
        print(f"  {name:11s} rows x length {shape!s:10s} {t} thread(s): {1 / median:5.2f} steps/s "
              f"{tokens / median:7.0f} tokens/s  ({median * 1000:5.0f} ms/step)")
    print(f"PPO pre-update pass, packed, {threads[0]} thread(s):")
    for label, ts in pre.items():
        print(f"  {label:12s} {statistics.median(ts) * 1000:5.0f} ms")


if __name__ == "__main__":
    main()
