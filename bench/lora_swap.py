"""LoRA adapter swap bench: how long the CPU engine stops generating to load an adapter, and what
serving adapters costs per decode.

The default model (rlfleet.engine.build_model.ModelSpec, ~3M parameters) in one CPU engine process
(`torch_threads` 1); rank-8 peft adapters on all seven projections (`rlfleet.engine.testing.
make_lora_adapter`, peft's own `save_pretrained`). While `--streams` generation requests run without
end (each with the adapter that was current when it started), the bench loads adapter v1, v2, ...
under new names and unloads the one before, as a promotion does. Per swap it records:

  pause   the engine's `pause_s`: the time the scheduler thread was held by the install (between two
          decode steps; reading and checking the files ran in a worker thread while serving);
  load    the `/load_lora_adapter` call's wall time (what the broker waits for);
  unload  the `/unload_lora_adapter` call's wall time.

The same swaps again in this process, on a scheduler thread of its own, with every decode step
timed: the gap between two decode steps while a swap runs (file reading in another thread included,
as the server does it) against the gaps of the same batch with no swap going on -- the pause as
generation sees it.

Then decode throughput with every row on the base model, every row on one adapter, and rows split
over two adapters and the base (tokens/s over the same requests, greedy).

    .venv/bin/python bench/lora_swap.py            # 20 swaps
    .venv/bin/python bench/lora_swap.py --swaps 5
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import tempfile
import time
from pathlib import Path

PROMPT = [1, *range(40, 80)]


def build_default_model(out: Path) -> Path:
    from rlfleet.engine.build_model import ModelSpec, build
    from rlfleet.engine.testing import calc_dialogues

    return build(out, calc_dialogues(300), 0, ModelSpec())


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


async def stream(client, names: list[str], stop: asyncio.Event, counts: list[int]) -> None:
    """Generates back to back with the newest adapter until stopped."""
    while not stop.is_set():
        result = await client.generate(PROMPT, {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True},
                                       lora_path=names[-1])
        counts[0] += len(result.output_ids)


async def swaps(client, url: str, adapters: list[Path], streams: int) -> list[tuple[float, float, float]]:
    from rlfleet.engine.testing import http_call

    status, first = await http_call(url, "/load_lora_adapter",
                                    {"lora_name": "v0", "lora_path": str(adapters[0])})
    assert status == 200, first
    print("first adapter into an idle engine (its layers hooked on first use): "
          f"pause {first['pause_s'] * 1e3:.3f} ms")
    names, stop, counts = ["v0"], asyncio.Event(), [0]
    workers = [asyncio.create_task(stream(client, names, stop, counts)) for _ in range(streams)]
    await asyncio.sleep(1.0)  # the batch is decoding
    rows = []
    for version, path in enumerate(adapters[1:], start=1):
        started = time.perf_counter()
        status, reply = await http_call(url, "/load_lora_adapter",
                                        {"lora_name": f"v{version}", "lora_path": str(path)})
        load_s = time.perf_counter() - started
        assert status == 200, reply
        names.append(f"v{version}")
        started = time.perf_counter()
        await client.unload_lora_adapter(f"v{version - 1}")
        rows.append((reply["pause_s"], load_s, time.perf_counter() - started))
        await asyncio.sleep(0.2)
    stop.set()
    await asyncio.gather(*workers)
    await client.unload_lora_adapter(names[-1])
    assert counts[0] > 0
    return rows


def step_gaps(model: Path, adapters: list[Path], rows: int = 4) -> tuple[list[float], list[float]]:
    """(decode-step gaps with no swap running, gaps that overlapped a swap), in seconds."""
    from rlfleet.engine.lora import read_adapter
    from rlfleet.engine.model_runner import ModelRunner
    from rlfleet.engine.protocol import GenerateItem, SamplingSpec
    from rlfleet.engine.scheduler import Request, Scheduler

    runner = ModelRunner(model)
    scheduler = Scheduler(runner, max_prefix_cache_tokens=0)
    stamps: list[float] = []
    decode = runner.decode

    def timed(*args, **kwargs):
        logits = decode(*args, **kwargs)
        stamps.append(time.perf_counter())
        return logits

    runner.decode = timed

    def load(path: Path, name: str):
        adapter = read_adapter(path, name, runner.lora.linears, runner.vocab_size)  # off the scheduler thread
        scheduler.call(lambda: scheduler.install_adapter(adapter)).result()
        return adapter

    first = read_adapter(adapters[0], "v0", runner.lora.linears, runner.vocab_size)
    scheduler.install_adapter(first)  # before the scheduler thread starts
    spec = SamplingSpec(max_new_tokens=900, temperature=0.0, ignore_eos=True)
    scheduler.start()
    for i in range(rows):
        scheduler.submit(Request(GenerateItem(f"r{i}", PROMPT, spec), runner.eos_token_ids,
                                 lambda out: None, first))
    time.sleep(1.0)
    windows = []
    for version, path in enumerate(adapters[1:], start=1):
        time.sleep(0.1)
        started = time.perf_counter()
        load(path, f"v{version}")
        scheduler.call(lambda v=version: scheduler.remove_adapter(f"v{v - 1}")).result()
        windows.append((started, time.perf_counter()))
    time.sleep(0.5)
    scheduler.stop()
    quiet, swapping = [], []
    for before, after in itertools.pairwise(stamps):
        overlaps = any(before < end and after > start for start, end in windows)
        (swapping if overlaps else quiet).append(after - before)
    return quiet, swapping


async def throughput(client, lora_paths, rounds: int = 3) -> float:
    """Output tokens/s of one batch of len(lora_paths) requests decoding together."""
    params = {"max_new_tokens": 64, "temperature": 0.0, "ignore_eos": True}
    await client.generate_batch([PROMPT] * len(lora_paths), params, lora_path=lora_paths)  # warm
    started, tokens = time.perf_counter(), 0
    for _ in range(rounds):
        results = await client.generate_batch([PROMPT] * len(lora_paths), params, lora_path=lora_paths)
        tokens += sum(len(r.output_ids) for r in results)
    return tokens / (time.perf_counter() - started)


async def main_async(args) -> None:
    import torch
    from safetensors.torch import load_file

    from rlfleet.common.engine_client import EngineClient
    from rlfleet.engine.testing import ALL_PROJECTIONS, EngineProcess, make_lora_adapter

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="lora-swap-") as tmp:
        work = Path(tmp)
        model = await asyncio.to_thread(build_default_model, work / "model")
        adapters = [await asyncio.to_thread(make_lora_adapter, model, work / f"v{i}", i, 8, 16.0,
                                            ALL_PROJECTIONS)
                    for i in range(args.swaps + 1)]
        params = sum(t.numel() for t in load_file(str(model / "model.safetensors")).values())
        quiet, swapping = await asyncio.to_thread(step_gaps, model, adapters)
        engine = await asyncio.to_thread(EngineProcess(model, work / "engine",
                                                       max_prefix_cache_tokens=0).start)
        try:
            async with EngineClient(engine.url) as client:
                rows = await swaps(client, engine.url, adapters, args.streams)
                await client.load_lora_adapter("a", str(adapters[0]))
                await client.load_lora_adapter("b", str(adapters[1]))
                rates = {
                    "base": await throughput(client, [None] * 6),
                    "one adapter": await throughput(client, ["a"] * 6),
                    "a, b and base mixed": await throughput(client, ["a", "b", None] * 2),
                }
        finally:
            engine.stop()
        adapter_kb = directory_bytes(adapters[0]) / 1024
        print(f"default model: {params / 1e6:.2f}M parameters, bf16 {params * 2 / 2**20:.2f} MB; "
              f"rank-8 adapter on {len(ALL_PROJECTIONS)} projections: {adapter_kb:.0f} KB on disk "
              f"({adapter_kb * 1024 / (params * 2):.1%} of the bf16 model)")
        print(f"{'swap':>4} {'pause ms':>9} {'load ms':>8} {'unload ms':>9}")
        for i, (pause, load, unload) in enumerate(rows, start=1):
            print(f"{i:>4} {pause * 1e3:9.3f} {load * 1e3:8.1f} {unload * 1e3:9.1f}")
        pauses = [pause * 1e3 for pause, _, _ in rows]
        print(f"pause over {len(rows)} swaps with {args.streams} requests decoding: median "
              f"{statistics.median(pauses):.3f} ms, max {max(pauses):.3f} ms (aim <= 10 ms): "
              f"{'met' if max(pauses) <= 10 else 'NOT met'}")
        print(f"load call median {statistics.median(r[1] for r in rows) * 1e3:.1f} ms (read + check in a "
              f"worker thread, while serving)")
        print(f"decode-step gap, 4 rows, in process: median {statistics.median(quiet) * 1e3:.2f} ms and max "
              f"{max(quiet) * 1e3:.2f} ms with no swap running ({len(quiet)} steps); "
              f"during the {len(rows)} swaps "
              f"median {statistics.median(swapping) * 1e3:.2f} ms, max {max(swapping) * 1e3:.2f} ms "
              f"({len(swapping)} steps)")
        for name, rate in rates.items():
            print(f"decode, 6 rows, {name}: {rate:.0f} tokens/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--swaps", type=int, default=20)
    parser.add_argument("--streams", type=int, default=4, help="requests generating during the swaps")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
