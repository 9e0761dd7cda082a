"""CPU engine decode throughput at concurrency 1, 8 and 32 on a freshly built default model.

    .venv/bin/python bench/engine_throughput.py [--threads 1] [--new-tokens 128] [--waves 2]

Builds the default model (`rlfleet-build-model` defaults) in a temp dir, starts `rlfleet-cpu-engine`
on a free port, and runs closed-loop clients: at concurrency C, C workers each send `--waves`
requests of `--new-tokens` tokens (ignore_eos, distinct seeds) one after the other. Prints generated
tokens/s per level and the ratio of concurrency 32 to concurrency 1. Continuous batching is what
makes the ratio large: a decode step costs about the same for 1 row as for 32.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from rlfleet.common.chat import render_messages
from rlfleet.common.engine_client import EngineClient, EngineTimeouts


def build_default_model(out: Path) -> str:
    from rlfleet.engine.build_model import ModelSpec, build
    from rlfleet.engine.testing import calc_dialogues
    from rlfleet.envkit.corpus import default_corpus

    try:
        texts, corpus = default_corpus(seed=0), "rlfleet.envkit default corpus"
    except SystemExit:  # the default corpus module is not there yet
        texts, corpus = calc_dialogues(2000, seed=0), "calc dialogues (rlfleet.engine.testing)"
    build(out, texts, seed=0, spec=ModelSpec())
    return corpus


async def run_level(
    client: EngineClient, prompts: list[list[int]], concurrency: int, waves: int, new_tokens: int
):
    latencies: list[float] = []
    generated = 0

    async def worker(index: int) -> None:
        nonlocal generated
        for wave in range(waves):
            params = {"max_new_tokens": new_tokens, "ignore_eos": True, "sampling_seed": index * 1000 + wave}
            result = await client.generate(
                prompts[(index + wave) % len(prompts)], params, return_logprob=True
            )
            assert len(result.output_ids) == new_tokens, result.finish_reason
            generated += len(result.output_ids)
            latencies.append(result.latency)

    started = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - started
    return generated / elapsed, statistics.median(latencies), elapsed


async def bench(url: str, tokenizer_path: Path, args) -> dict[int, float]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    questions = [f"What is {a}*({a + 3}+{a % 7})?" for a in range(1, 41)]
    prompts = [
        tokenizer.encode(render_messages([{"role": "user", "content": q}], add_generation_prompt=True)).ids
        for q in questions
    ]
    results = {}
    async with EngineClient(url, timeouts=EngineTimeouts(generate_s=3600)) as client:
        await run_level(client, prompts, 4, 1, 16)  # warm-up
        for concurrency in args.concurrency:
            tps, p50, elapsed = await run_level(client, prompts, concurrency, args.waves, args.new_tokens)
            results[concurrency] = tps
            print(
                f"concurrency {concurrency:>3}: {tps:8.1f} generated tokens/s   "
                f"p50 request latency {p50:6.2f}s   ({concurrency * args.waves} requests in {elapsed:.1f}s)",
                flush=True,
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="engine torch threads")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--waves", type=int, default=2, help="requests per worker, back to back")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args()

    from rlfleet.engine.testing import EngineProcess

    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-") as tmp:
        model = Path(tmp) / "model"
        corpus = build_default_model(model)
        config = json.loads((model / "config.json").read_text())
        print(
            f"model: qwen2 hidden {config['hidden_size']} x {config['num_hidden_layers']} layers, "
            f"vocab {config['vocab_size']} (tokenizer corpus: {corpus}); "
            f"engine torch threads {args.threads}; "
            f"{args.new_tokens} new tokens per request",
            flush=True,
        )
        with EngineProcess(
            model, Path(tmp) / "engine", torch_threads=args.threads, max_running_requests=64
        ) as engine:
            results = asyncio.run(bench(engine.url, model / "tokenizer.json", args))
    if 1 in results and 32 in results:
        print(f"ratio concurrency 32 / concurrency 1: {results[32] / results[1]:.1f}x")


if __name__ == "__main__":
    main()
