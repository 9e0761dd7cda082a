"""The CPU engine computing in fp32 vs bf16 (`engine.dtype`), side by side: prefill and decode.

    .venv/bin/python bench/engine_dtype.py [--requests 32] [--new-tokens 24] [--threads 1] [--rounds 3]

Builds the default model (as `bench/engine_throughput.py` does), loads it into a `ModelRunner` of
each dtype, and runs `--requests` calc prompts through the engine's own scheduler in-process (no
HTTP): all submitted at once, so one batched prefill and then batched decode steps, `--new-tokens`
each (ignore_eos). Rounds alternate the dtypes so that a machine whose load moves moves both alike;
the median is printed: milliseconds of the prefill pass, of one decode step, and generated tokens
per second over the whole round. bf16 runs its matmuls on AMX where the CPU has it (`lscpu | grep
amx`); elsewhere it may be slower than fp32.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import build_default_model

DTYPES = ("float32", "bfloat16")


def one_round(runner, requests: int, new_tokens: int) -> tuple[float, float, float]:
    """(prefill ms, decode ms per step, generated tokens/s) of one batch through the scheduler."""
    from rlfleet.engine.testing import Harness, item, prompt

    harness = Harness(runner, max_prefix_cache_tokens=0)
    harness.submit(*(item(f"r{i}", prompt(runner, f"What is {i + 10}*({i + 3}+{i % 7})?"),
                          max_new_tokens=new_tokens, temperature=1.0, sampling_seed=i, ignore_eos=True)
                     for i in range(requests)))
    started = time.perf_counter()
    harness.steps(1)  # admits every request: the batched prefill (and its first token)
    prefill = time.perf_counter() - started
    harness.run(requests)
    total = time.perf_counter() - started
    decode_steps = max(harness.scheduler.decode_steps, 1)
    return prefill * 1000, (total - prefill) * 1000 / decode_steps, requests * new_tokens / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32, help="prompts in the batch")
    parser.add_argument("--new-tokens", type=int, default=24, help="tokens generated per request")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per dtype (after a warm-up)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from rlfleet.engine.model_runner import ModelRunner

    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-") as tmp:
        build_default_model(Path(tmp) / "model")
        runners = {dtype: ModelRunner(Path(tmp) / "model", dtype) for dtype in DTYPES}
        results: dict[str, list[tuple[float, float, float]]] = {dtype: [] for dtype in DTYPES}
        for r in range(args.rounds + 1):
            for dtype, runner in runners.items():
                figures = one_round(runner, args.requests, args.new_tokens)
                if r:  # round 0 warms up allocators and kernels
                    results[dtype].append(figures)
    print(f"{args.requests} requests x {args.new_tokens} new tokens, one batch; torch threads "
          f"{args.threads}; median of {args.rounds} interleaved rounds")
    base = statistics.median(f[2] for f in results["float32"])
    for dtype, rounds in results.items():
        prefill, decode, rate = (statistics.median(f[i] for f in rounds) for i in range(3))
        print(f"  {dtype:9s} prefill {prefill:7.1f} ms   decode step {decode:6.2f} ms   "
              f"{rate:7.0f} tokens/s  ({rate / base:4.2f}x fp32)")


if __name__ == "__main__":
    main()
