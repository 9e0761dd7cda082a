"""CPU engine prefill of second turns: from scratch, from the prefix cache one by one, and batched.

    .venv/bin/python bench/engine_prefill.py [--requests 16] [--threads 1] [--repeats 5]

Builds the default model (as `bench/engine_throughput.py` does) and times, for `--requests` second
turns of calc episodes (turn 1's prompt + 12 generated tokens + a tool observation), the three ways
the engine's scheduler can prefill them:

  scratch    one forward pass per request over all its tokens (no prefix cache);
  cached     one pass per request over the tokens after turn 1 (prefix cache hit);
  batched    one pass for all of them (what the scheduler does when they are admitted together).

Prints milliseconds per request for each. It measures `ModelRunner` directly, so it shows the cost
of the forward passes themselves, without HTTP or the decode steps around them.
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

from rlfleet.common.chat import render_messages


def second_turns(runner, count: int) -> list[tuple[list[int], int]]:
    """(token ids of turn 2's prompt, how many of them turn 1 already had) per episode."""
    turns = []
    for a in range(count):
        first = runner.encode(render_messages([{"role": "user", "content": f"What is {a + 10}*{a + 37}?"}],
                                              add_generation_prompt=True))
        generated = runner.encode(f"<calc>{a + 10}*{a + 37}</calc>")[:12]
        observation = runner.encode(f"<|im_end|>\n<|im_start|>tool\n{(a + 10) * (a + 37)}<|im_end|>\n"
                                    "<|im_start|>assistant\n")
        turns.append((first + generated + observation, len(first) + len(generated)))
    return turns


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16, help="second turns prefilled together")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from rlfleet.engine.kv_cache import PaddedKVCache
    from rlfleet.engine.model_runner import ModelRunner

    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-") as tmp:
        build_default_model(Path(tmp) / "model")
        runner = ModelRunner(Path(tmp) / "model")
        turns = second_turns(runner, args.requests)
        # The KV turn 1 left behind, as the prefix cache holds it.
        prefixes = []
        for tokens, reused in turns:
            _, cache = runner.prefill(tokens[:reused])
            prefixes.append(cache.row(0))

        def scratch() -> None:
            for tokens, _ in turns:
                runner.prefill(tokens)

        def cached() -> None:
            for (tokens, _), (keys, values) in zip(turns, prefixes, strict=True):
                runner.prefill(tokens, cached=PaddedKVCache.from_prefix(keys, values, len(tokens) + 16))

        def batched() -> None:
            fed = max(len(tokens) - reused for tokens, reused in turns)
            kept = [max(0, len(tokens) - fed) for tokens, _ in turns]
            runner.prefill_rows([tokens for tokens, _ in turns], prefixes, kept, fed)

        n = len(turns)
        mean_len = sum(len(t) for t, _ in turns) / n
        mean_new = sum(len(t) - r for t, r in turns) / n
        print(f"{n} second turns of {mean_len:.0f} tokens, {mean_new:.0f} of them new; "
              f"torch threads {args.threads}")
        results = {name: timed(fn, args.repeats) * 1000 / n for name, fn in
                   (("scratch", scratch), ("cached", cached), ("batched", batched))}
        for name, ms in results.items():
            print(f"{name:8s} {ms:6.2f} ms per request   ({results['scratch'] / ms:4.1f}x scratch)")


if __name__ == "__main__":
    main()
