"""Does tokenizing in a worker thread keep the event loop free? `encode` vs `encode_batch`.

    .venv/bin/python bench/tokenize_off_loop.py [--chars 270000] [--concurrent 2]

Tokenizes `--concurrent` texts of `--chars` characters in worker threads (asyncio.to_thread) with
the default model's tokenizer (trained as the tests train it) while a 10 ms ticker runs on the
loop, and prints the longest stall the ticker saw for each method. HF tokenizers' `encode` holds
the GIL for its whole run, so threads do not help; `encode_batch` releases it.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from rlfleet.engine.build_model import train_tokenizer
from rlfleet.engine.testing import calc_dialogues


async def longest_stall(work) -> tuple[float, float]:
    stalls: list[float] = []

    async def ticker() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            stalls.append(now - last - 0.01)
            last = now

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.1)
    started = time.perf_counter()
    await work()
    took = time.perf_counter() - started
    tick.cancel()
    return max(stalls), took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chars", type=int, default=270_000)
    parser.add_argument("--concurrent", type=int, default=2)
    args = parser.parse_args()
    tokenizer = train_tokenizer(calc_dialogues(300), 512)
    text = ("12 + 34 = 46, what is 7*8? " * (args.chars // 27 + 1))[: args.chars]
    methods = {
        "encode": lambda: tokenizer.encode(text, add_special_tokens=False),
        "encode_batch": lambda: tokenizer.encode_batch([text], add_special_tokens=False),
    }
    for name, fn in methods.items():
        async def work(fn=fn) -> None:
            await asyncio.gather(*(asyncio.to_thread(fn) for _ in range(args.concurrent)))

        stall, took = asyncio.run(longest_stall(work))
        print(f"{name:13s} {args.concurrent} x {args.chars} chars in threads: {took:.2f} s, "
              f"longest event-loop stall {stall:.3f} s")


if __name__ == "__main__":
    main()
