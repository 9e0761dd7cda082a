"""Test helpers shared by the engine's tests and its clients' tests: a calc-dialogue corpus, a very
small model, and an engine process that is started on a free port and stopped by its PID.

Torch and transformers are imported inside the helpers that need them: a client's tests (the
gateway's) use `EngineProcess` and `http_call` without loading torch into the test process."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from rlfleet.common.chat import render_messages
from rlfleet.common.processes import ServiceProcess
from rlfleet.common.security import engine_keys
from rlfleet.engine.build_model import ModelSpec, build
from rlfleet.engine.server import ADMIN_ROUTES
from rlfleet.weights import to_served

if TYPE_CHECKING:
    from rlfleet.engine.protocol import GenerateItem
    from rlfleet.engine.scheduler import RequestOutput

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


# --- the scheduler in-process (the engine's own tests) ---------------------------------------
def prompt(runner, question: str) -> list[int]:
    return runner.encode(render_messages([{"role": "user", "content": question}], add_generation_prompt=True))


def item(rid: str, ids: list[int], **sampling) -> GenerateItem:
    from rlfleet.engine.protocol import GenerateItem, SamplingSpec

    return GenerateItem(rid, ids, SamplingSpec(**sampling), return_logprob=True)


class Harness:
    """A scheduler driven step by step in-process, plus the outputs it delivered, keyed by rid."""

    def __init__(self, runner, **limits) -> None:
        from rlfleet.engine.scheduler import Scheduler

        self.runner = runner
        self.scheduler = Scheduler(runner, **limits)
        self.outputs: dict[str, RequestOutput] = {}

    def submit(self, *items: GenerateItem, eos: frozenset[int] | None = None) -> None:
        from rlfleet.engine.scheduler import Request

        for it in items:
            eos_ids = self.runner.eos_token_ids if eos is None else eos
            self.scheduler.submit(Request(it, eos_ids, lambda out: self.outputs.__setitem__(out.rid, out)))

    def run(self, count: int, max_steps: int = 5000) -> dict[str, RequestOutput]:
        for _ in range(max_steps):
            if len(self.outputs) >= count:
                return self.outputs
            self.scheduler.step()
        raise AssertionError(f"only {len(self.outputs)} of {count} requests finished")

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.scheduler.step()


def alone(runner, it: GenerateItem, **kwargs) -> RequestOutput:
    harness = Harness(runner)
    harness.submit(it, **kwargs)
    return harness.run(1)[it.rid]


def sampled_items(runner, count: int) -> list[GenerateItem]:
    questions = ["What is 12*(3+4)?", "Compute 7-2.", "how much is 5+5+5", "Please evaluate (9-1)*3"]
    return [
        item(
            f"r{i}",
            prompt(runner, questions[i % len(questions)]) + [7 + i] * i,  # distinct lengths
            max_new_tokens=12 + 5 * i,
            temperature=[1.0, 0.7, 0.0, 1.3][i % 4],
            top_p=[1.0, 0.9, 1.0, 0.8][i % 4],
            top_k=[-1, 40, -1, 20][i % 4],
            sampling_seed=1000 + i,
            ignore_eos=True,
        )
        for i in range(count)
    ]


def write_corpus(path: Path, texts: list[str]) -> Path:
    """One text per line, newlines written as a literal backslash-n (what --corpus reads)."""
    path.write_text("".join(t.replace("\n", "\\n") + "\n" for t in texts), encoding="utf-8")
    return path


def build_tiny_model(out: Path, seed: int = 0, corpus_seed: int = 0, family: str = "qwen2",
                     dtype: str = "float32", **sizes) -> Path:
    """A model small enough for unit tests (~0.2M parameters), of any family in
    `rlfleet.common.families` (its tokenizer trained on the same calc corpus)."""
    from rlfleet.common.families import family as model_family

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
    return build(out, calc_dialogues(300, corpus_seed), seed, ModelSpec(**spec), model_family(family), dtype)


class EngineProcess(ServiceProcess):
    """`rlfleet-cpu-engine` serving `model_path` in a child process, on a free port, stopped by PID;
    `config` is any of EngineConfig's keys."""

    def __init__(self, model_path: Path, workdir: Path, **config) -> None:
        self.model_path = Path(model_path)
        # An engine loads weights only from under a store root; a test's own files sit beside its workdir.
        config.setdefault("weight_store_root", str(Path(workdir).parent))
        env = {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
        super().__init__("rlfleet-cpu-engine", workdir, env=env, name="engine",
                         config={"model_path": str(model_path), "torch_threads": 1, **config})

    def start(self, timeout_s: float = 90.0) -> EngineProcess:
        super().start(timeout_s)
        assert self.info["pid"] == self.pid, self.info
        return self


_built_models: dict[tuple[Path, int], Path] = {}


def tiny_model(root: Path, seed: int = 0) -> Path:
    """The tiny test model, built once per test process under `root` (torch is imported here, in
    the test process, never in a light service)."""
    key = (Path(root), seed)
    if key not in _built_models:
        _built_models[key] = build_tiny_model(Path(root) / f"tiny-seed{seed}", seed=seed)
    return _built_models[key]


ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_lora_adapter(model_path: Path, out: Path, seed: int, rank: int = 4, alpha: float = 8.0,
                      target_modules=ALL_PROJECTIONS, scale: float = 0.1, **config) -> Path:
    """A peft LoRA adapter directory over `model_path` (peft's own `save_pretrained`), with nonzero A
    and B drawn from `seed` (peft initialises B to zero, which would make every adapter the base
    model); `config` goes to peft's LoraConfig (e.g. use_dora=True)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)  # a str is a regex
    # peft's annotation is too narrow: lora_alpha is typed int, yet peft only divides by it (alpha / r).
    lora = LoraConfig(r=rank, lora_alpha=alpha,  # type: ignore[arg-type]
                      lora_dropout=0.0, target_modules=targets, **config)
    peft_model = get_peft_model(model, lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    peft_model.save_pretrained(str(out))
    return Path(out)


def merged_lora_model(model_path: Path, adapter_path: Path):
    """The base model with the adapter merged into its weights by peft (`merge_and_unload`), in fp32:
    the reference an engine serving the adapter must match."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    return PeftModel.from_pretrained(model, str(adapter_path)).merge_and_unload().eval()


def token_logprobs(model, tokens: list[int]) -> list[float]:
    """log p(tokens[i] | tokens[:i]) for i >= 1 under an HF causal LM (teacher-forced, fp32)."""
    import torch

    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    return logprobs.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].tolist()


def auth_headers(path: str) -> dict[str, str]:
    """The run's engine key a route wants (admin routes the admin key), as the gateway and broker send it."""
    api, admin = engine_keys()
    route = path.partition("?")[0]  # the server checks the route, never the query string
    key = admin if route in ADMIN_ROUTES or route.startswith("/rlfleet/") else api
    return {"Authorization": f"Bearer {key}"} if key else {}


async def http_call(url: str, path: str, body=None, method: str = "POST", within_s: float = 60.0):
    """(status, JSON or text) of one request; a fresh session each time keeps tests independent."""
    async with aiohttp.ClientSession() as session:
        request = session.request(
            method, url + path, json=body, timeout=aiohttp.ClientTimeout(total=within_s),
            headers=auth_headers(path)
        )
        async with request as response:
            if response.content_type == "application/json":
                return response.status, await response.json()
            return response.status, await response.text()


def generate_in_process(runner, ids: list[int], **sampling):
    """The same request through an in-process scheduler on `runner`: the reference for HTTP results."""
    from rlfleet.engine.protocol import GenerateItem, SamplingSpec
    from rlfleet.engine.scheduler import Request, Scheduler

    outputs: list[RequestOutput] = []
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
        status, values = await http_call(url, "/get_weights_by_name",
                                         {"name": name, "truncate_size": 1 << 30})
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


def served_routes() -> dict[str, list[str]]:
    """Path -> methods of every route the engine's HTTP app serves (built without a model: the app's
    route table does not touch the runner), for the contract tests against SGLang's route table."""
    from rlfleet.engine.config import EngineConfig
    from rlfleet.engine.server import EngineServer

    server = EngineServer.__new__(EngineServer)  # the route table only: no model, no scheduler
    server.config = EngineConfig()
    server.traced = False
    routes: dict[str, set[str]] = {}
    for resource in server.app().router.resources():
        for route in resource:
            if route.method != "HEAD":
                routes.setdefault(resource.canonical, set()).add(route.method)
    return {path: sorted(methods) for path, methods in routes.items()}
