"""Test helpers shared by the engine's tests and its clients' tests: a calc-dialogue corpus, a very
small model, and an engine process that is started on a free port and stopped by its PID."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from rlfleet.common.chat import render_messages

SYSTEM = "You are a calculator agent. Call <calc>expression</calc>, then reply <answer>number</answer>."


def calc_dialogues(count: int, seed: int = 0) -> list[str]:
    """ChatML calculator episodes: question, tool call, tool result, answer."""
    rng = random.Random(seed)
    questions = ("What is {e}?", "Compute {e}.", "Please evaluate {e}", "how much is {e}")
    texts = []
    for _ in range(count):
        a, b, c = rng.randint(1, 999), rng.randint(1, 99), rng.randint(1, 9)
        op = rng.choice("+-*")
        expression = rng.choice([f"{a}{op}{b}", f"{a}*({b}+{c})", f"({a}-{b})*{c}", f"{a}+{b}+{c}"])
        value = eval(expression)  # our own arithmetic strings
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": rng.choice(questions).format(e=expression)},
            {"role": "assistant", "content": f"<calc>{expression}</calc>"},
            {"role": "tool", "content": str(value)},
            {"role": "assistant", "content": f"The result is <answer>{value}</answer>"},
        ]
        texts.append(render_messages(messages, add_generation_prompt=False))
    return texts


def write_corpus(path: Path, texts: list[str]) -> Path:
    """One text per line, newlines written as a literal backslash-n (what --corpus reads)."""
    path.write_text("".join(t.replace("\n", "\\n") + "\n" for t in texts), encoding="utf-8")
    return path


def build_tiny_model(out: Path, seed: int = 0, corpus_seed: int = 0, **sizes) -> Path:
    """A model small enough for unit tests (~0.2M parameters)."""
    from rlfleet.engine.build_model import ModelSpec, build

    spec = {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        **sizes,
    }
    return build(out, calc_dialogues(300, corpus_seed), seed, ModelSpec(**spec))


class EngineProcess:
    """`rlfleet-cpu-engine` in a child process, on a free port, stopped by PID."""

    def __init__(self, model_path: Path, workdir: Path, **config) -> None:
        self.model_path = Path(model_path)
        self.workdir = Path(workdir)
        self.config = {"torch_threads": 1, **config}
        self.process: subprocess.Popen | None = None
        self.url = ""
        self.port = 0

    def start(self, timeout_s: float = 90.0) -> EngineProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        ready = self.workdir / f"engine-{time.monotonic_ns()}.ready.json"
        args = [
            sys.executable,
            "-m",
            "rlfleet.engine.main",
            "--model-path",
            str(self.model_path),
            "--ready-file",
            str(ready),
        ]
        for key, value in self.config.items():
            args += [f"--{key.replace('_', '-')}", str(value)]
        self.log_path = ready.with_suffix(".log")
        log = self.log_path.open("wb")
        env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"engine exited with {self.process.returncode}:\n{self.log_path.read_text()[-4000:]}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(
                    f"engine not ready after {timeout_s}s:\n{self.log_path.read_text()[-4000:]}"
                )
            time.sleep(0.1)
        info = json.loads(ready.read_text())
        assert info["pid"] == self.process.pid, info
        self.url, self.port = info["url"], info["port"]
        return self

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.kill(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=15)

    def __enter__(self) -> EngineProcess:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


async def http_call(url: str, path: str, body=None, method: str = "POST", within_s: float = 60.0):
    """(status, JSON or text) of one request; a fresh session each time keeps tests independent."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        request = session.request(
            method, url + path, json=body, timeout=aiohttp.ClientTimeout(total=within_s)
        )
        async with request as response:
            if response.content_type == "application/json":
                return response.status, await response.json()
            return response.status, await response.text()


async def eventually(predicate, within_s: float = 20.0, every_s: float = 0.02) -> None:
    """Polls the async `predicate` until it is true; fails after `within_s`."""
    import asyncio

    for _ in range(int(within_s / every_s)):
        if await predicate():
            return
        await asyncio.sleep(every_s)
    raise AssertionError(f"condition not reached within {within_s}s")


def generate_in_process(runner, ids: list[int], **sampling):
    """The same request through an in-process scheduler on `runner`: the reference for HTTP results."""
    from rlfleet.engine.protocol import GenerateItem, SamplingSpec
    from rlfleet.engine.scheduler import Request, Scheduler

    outputs = []
    scheduler = Scheduler(runner)
    scheduler.submit(
        Request(
            GenerateItem("reference", ids, SamplingSpec(**sampling)), runner.eos_token_ids, outputs.append
        )
    )
    while not outputs:
        scheduler.step()
    return outputs[0]


class StoreTrainer:
    """A trainer stand-in for weight-sync tests: a copy of a model directory's weights in fp32 that
    takes AdamW steps on random tokens and publishes each version to a `DirectoryWeightStore`.

    `served(v)` is what the trainer published as version v (its bf16 bytes), the reference an
    engine's weights must equal bit for bit.
    """

    def __init__(self, model_path: Path, store, lr: float = 1e-4, seed: int = 0) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.store = store
        self.version = 0
        self.published: dict[int, object] = {}

    def step(self, tokens: int = 32) -> None:
        import torch

        ids = torch.randint(0, self.model.config.vocab_size, (2, tokens))
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def publish(self, kind: str | None = None) -> dict:
        """Writes the current weights as the next version; returns the store's manifest."""
        from rlfleet.weights import to_served

        self.version += 1
        manifest = self.store.write_version(self.version, self.model.state_dict(), kind=kind)
        self.published[self.version] = to_served(self.model.state_dict())
        return manifest

    def served(self, version: int):
        return self.published[version]


async def read_engine_weights(url: str, names) -> dict:
    """Every row of each named parameter, read back through `/get_weights_by_name` (fp32 values)."""
    import torch

    weights = {}
    for name in names:
        status, values = await http_call(url, "/get_weights_by_name", {"name": name, "truncate_size": 1 << 30})
        if status != 200:
            raise AssertionError(f"get_weights_by_name {name}: {status} {values}")
        weights[name] = torch.tensor(values, dtype=torch.float32)
    return weights


async def assert_engine_serves(url: str, served) -> None:
    """The engine's fp32 weights are exactly `served` (a `ServedTensors`, e.g. bf16 bytes) upcast."""
    import torch

    got = await read_engine_weights(url, list(served))
    for name in served:
        want = torch.from_numpy(served.to_float32(name).reshape(served[name].shape))
        if not torch.equal(got[name], want):
            diff = (got[name] != want).sum().item()
            raise AssertionError(f"{name}: {diff} values differ from the trainer's")
