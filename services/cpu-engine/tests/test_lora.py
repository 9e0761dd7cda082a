"""LoRA adapters in the CPU engine, against peft itself: the adapter's log-probs are the peft-merged
model's, several adapters and the base model share one batch, refusals are SGLang's, and the prefix
cache never hands one adapter's KV to another."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlfleet.common.engine_client import EngineClient, EngineRejected, adapter_missing
from rlfleet.engine.lora import LoRALoadError, read_adapter
from rlfleet.engine.model_runner import ModelRunner
from rlfleet.engine.protocol import GenerateItem, SamplingSpec
from rlfleet.engine.scheduler import Request, Scheduler
from rlfleet.engine.testing import (
    EngineProcess,
    http_call,
    make_lora_adapter,
    merged_lora_model,
    token_logprobs,
)

# More tokens than one prefix-cache block.
PROMPT = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59]


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_lora_adapter(model_dir, root / "a", seed=1, rank=4, alpha=8.0),
        # Another rank, alpha and set of targets: scaling alpha / r differs, and so do the hooked layers.
        "b": make_lora_adapter(model_dir, root / "b", seed=2, rank=8, alpha=4.0,
                               target_modules=("q_proj", "v_proj", "down_proj")),
    }


@pytest.fixture(scope="module")
def references(model_dir, adapters):
    models = {name: merged_lora_model(model_dir, path) for name, path in adapters.items()}
    models[None] = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return models


@pytest.fixture()
def fresh_runner(model_dir):
    return ModelRunner(model_dir)  # adapters installed here stay out of the shared runner


def load(runner: ModelRunner, path, name: str):
    adapter = read_adapter(path, name, runner.lora.linears, runner.vocab_size)
    runner.lora.install(adapter)
    return adapter


def run(scheduler: Scheduler, runner: ModelRunner, prompts, adapters, max_new_tokens: int = 6):
    """Submits every prompt at once (so they share prefill and decode passes); outputs in order."""
    outputs = {}
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters, strict=True)):
        sampling = SamplingSpec(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        item = GenerateItem(f"r{i}", list(prompt), sampling, return_logprob=True)
        scheduler.submit(Request(item, runner.eos_token_ids,
                                 lambda out, i=i: outputs.__setitem__(i, out), adapter))
    while len(outputs) < len(prompts):
        scheduler.step()
    return [outputs[i] for i in range(len(prompts))]


def max_gap(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want)
    return max(abs(g - w) for g, w in zip(got, want, strict=True))


def test_an_adapter_gives_the_log_probs_of_the_peft_merged_model(fresh_runner, adapters, references):
    runner = fresh_runner
    base_weight = runner.parameter("model.layers.0.self_attn.q_proj.weight")
    before, pointer = base_weight.clone(), base_weight.data_ptr()
    adapter = load(runner, adapters["a"], "a")
    logits, _ = runner.prefill(PROMPT, all_logits=True, adapter=adapter)
    got = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0].tolist()
    assert max_gap(got, token_logprobs(references["a"], PROMPT)) <= 1e-4
    # The adapter matters (so the comparison above can fail), and the base weights were neither
    # copied nor changed: the base model still gives its own log-probs.
    assert max_gap(got, token_logprobs(references[None], PROMPT)) > 1e-2
    assert base_weight.data_ptr() == pointer and torch.equal(base_weight, before)
    logits, _ = runner.prefill(PROMPT, all_logits=True)
    base = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0].tolist()
    assert max_gap(base, token_logprobs(references[None], PROMPT)) <= 1e-4


def test_target_modules_as_a_regex_and_excluded_modules_read_as_peft_reads_them(
    fresh_runner, model_dir, tmp_path
):
    runner = fresh_runner
    path = make_lora_adapter(model_dir, tmp_path / "c", seed=6, target_modules=r".*\.(q_proj|up_proj)",
                             exclude_modules=["layers.0.mlp.up_proj"])
    adapter = load(runner, path, "c")
    assert sorted(adapter.weights) == ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj",
                                       "model.layers.1.self_attn.q_proj"]
    logits, _ = runner.prefill(PROMPT, all_logits=True, adapter=adapter)
    got = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0].tolist()
    assert max_gap(got, token_logprobs(merged_lora_model(model_dir, path), PROMPT)) <= 1e-4


def test_two_adapters_and_the_base_model_in_one_batch_each_get_their_own_outputs(fresh_runner, adapters,
                                                                                 references):
    runner = fresh_runner
    a, b = load(runner, adapters["a"], "a"), load(runner, adapters["b"], "b")
    scheduler = Scheduler(runner, max_prefix_cache_tokens=0)
    prompts = [PROMPT, PROMPT[:9], PROMPT[3:], PROMPT]
    rows = [a, None, b, b]
    outputs = run(scheduler, runner, prompts, rows)
    assert scheduler.prefill_passes == 1  # one batched prefill, then batched decodes
    for prompt, adapter, out in zip(prompts, rows, outputs, strict=True):
        reference = references[None if adapter is None else adapter.name]
        want = token_logprobs(reference, prompt + out.output_ids)[len(prompt) - 1:]
        assert max_gap(out.output_logprobs, want) <= 1e-4, adapter and adapter.name
        # Greedy: each token is the reference's argmax, so each row followed its own model.
        with torch.inference_mode():
            logits = reference(input_ids=torch.tensor([prompt + out.output_ids])).logits[0]
        assert out.output_ids == logits[len(prompt) - 1:-1].argmax(-1).tolist()
        version = "default" if adapter is None else adapter.name
        assert out.weight_version_spans == [(version, 0, len(out.output_ids))]
    first, last = outputs[0], outputs[3]
    assert first.output_ids != last.output_ids or first.output_logprobs != last.output_logprobs


def test_a_prefix_cached_under_one_adapter_is_not_reused_for_another(fresh_runner, adapters, references):
    runner = fresh_runner
    a, b = load(runner, adapters["a"], "a"), load(runner, adapters["b"], "b")
    scheduler = Scheduler(runner)
    first = run(scheduler, runner, [PROMPT], [a])[0]
    assert first.cached_tokens == 0 and scheduler.prefix_cache.entries == 1
    for adapter in (b, None):  # same tokens, other weights: nothing reused, outputs their own
        out = run(scheduler, runner, [PROMPT], [adapter])[0]
        assert out.cached_tokens == 0
        reference = references[None if adapter is None else adapter.name]
        assert max_gap(out.output_logprobs,
                       token_logprobs(reference, PROMPT + out.output_ids)[len(PROMPT) - 1:]) <= 1e-4
    again = run(scheduler, runner, [PROMPT], [a])[0]
    assert again.cached_tokens >= 16 and again.output_ids == first.output_ids  # a's own KV is reused
    # Unloading drops the adapter's entries; a reload of the same directory is a new namespace.
    scheduler.remove_adapter("a")
    assert scheduler.prefix_cache.entries == 2  # b's and the base model's
    reloaded = load(runner, adapters["a"], "a")
    assert run(scheduler, runner, [PROMPT], [reloaded])[0].cached_tokens == 0


def test_adapters_sglang_refuses_are_refused(fresh_runner, adapters, model_dir, tmp_path):
    runner = fresh_runner
    dora = make_lora_adapter(model_dir, tmp_path / "dora", seed=3, use_dora=True)
    with pytest.raises(LoRALoadError, match="doesn't support DoRA adapters"):
        read_adapter(dora, "dora", runner.lora.linears, runner.vocab_size)
    foreign = shutil.copytree(adapters["a"], tmp_path / "foreign")
    config = json.loads((foreign / "adapter_config.json").read_text())
    non_linear_targets = {**config, "target_modules": ["q_proj", "c_attn"]}
    (foreign / "adapter_config.json").write_text(json.dumps(non_linear_targets))
    with pytest.raises(LoRALoadError, match=r"target modules \['c_attn'\] are not linear layers"):
        read_adapter(foreign, "foreign", runner.lora.linears, runner.vocab_size)
    (foreign / "adapter_config.json").write_text(json.dumps({**config, "r": 3}))
    with pytest.raises(LoRALoadError, match="lora_A"):
        read_adapter(foreign, "foreign", runner.lora.linears, runner.vocab_size)
    (foreign / "added_tokens.json").write_text(json.dumps({"<new>": runner.vocab_size}))
    (foreign / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(LoRALoadError, match="add tokens to the vocabulary"):
        read_adapter(foreign, "foreign", runner.lora.linears, runner.vocab_size)
    with pytest.raises(LoRALoadError, match="is not a directory"):
        read_adapter(tmp_path / "missing", "missing", runner.lora.linears, runner.vocab_size)
    load(runner, adapters["a"], "a")
    with pytest.raises(LoRALoadError, match="because it is already loaded"):
        load(runner, adapters["b"], "a")
    with pytest.raises(LoRALoadError, match="LoRA with name nope does not exist"):
        runner.lora.remove("nope")


# --- over HTTP, through the engine client ---------------------------------------------------------
@pytest.fixture(scope="module")
def lora_engine(model_dir, tmp_path_factory):
    process = EngineProcess(model_dir, tmp_path_factory.mktemp("lora-engine")).start()
    yield process
    process.stop()


async def test_the_engine_client_loads_generates_with_and_unloads_adapters(lora_engine, adapters, references,
                                                                           model_dir, tmp_path):
    async with EngineClient(lora_engine.url) as client:
        assert await client.load_lora_adapter("a", str(adapters["a"])) == {"a": str(adapters["a"])}
        moved = shutil.copytree(adapters["b"], tmp_path / "b")
        assert set(await client.load_lora_adapter("b", str(moved), pinned=True)) == {"a", "b"}
        # /v1/models as SGLang's: the base model's card, then each adapter with `parent` = the base.
        assert await client.loaded_adapters() == {"a": str(adapters["a"]), "b": str(moved)}
        status, models = await http_call(lora_engine.url, "/v1/models", method="GET")
        assert status == 200 and [(c["id"], c["parent"]) for c in models["data"]] == [
            (str(model_dir), None), ("a", str(model_dir)), ("b", str(model_dir))]
        params = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
        batch = [PROMPT, PROMPT, PROMPT[:12]]
        results = await client.generate_batch(batch, params, lora_path=["a", None, "b"])
        for prompt, name, result in zip(batch, ["a", None, "b"], results, strict=True):
            want = token_logprobs(references[name], prompt + result.output_ids)[len(prompt) - 1:]
            assert max_gap(result.output_logprobs, want) <= 1e-4
            assert [r.version for r in result.weight_versions] == [name or "default"]
        with pytest.raises(EngineRejected, match="never been loaded: c") as never:
            await client.generate(PROMPT, params, lora_path="c")
        assert never.value.status == 400 and adapter_missing(never.value)
        with pytest.raises(EngineRejected, match="because it is already loaded"):
            await client.load_lora_adapter("a", str(adapters["b"]))
        assert await client.unload_lora_adapter("b") == {"a": str(adapters["a"])}
        with pytest.raises(EngineRejected, match="LoRA with name b does not exist"):
            await client.unload_lora_adapter("b")
        # After an unload a request naming it reloads it from its directory, as SGLang 0.5.23 does;
        # with the directory gone, it is an error.
        shutil.rmtree(moved)
        with pytest.raises(EngineRejected, match="Failed to implicitly load LoRA adapter b") as gone:
            await client.generate(PROMPT, params, lora_path="b")
        assert gone.value.status == 400 and adapter_missing(gone.value)
        await client.unload_lora_adapter("a")
        again = await client.generate(PROMPT, params, lora_path="a")
        assert again.output_ids == results[0].output_ids
        assert await client.unload_lora_adapter("a") == {}
        assert await client.loaded_adapters() == {}


async def test_bad_lora_requests_get_sglangs_error_shapes(lora_engine, model_dir, tmp_path):
    dora = make_lora_adapter(model_dir, tmp_path / "dora", seed=3, use_dora=True)
    status, body = await http_call(lora_engine.url, "/load_lora_adapter",
                                   {"lora_name": "d", "lora_path": str(dora)})
    assert status == 400 and body["success"] is False and "DoRA" in body["error_message"]
    status, body = await http_call(lora_engine.url, "/load_lora_adapter", {"lora_name": "x"})
    assert status == 400 and "lora_path" in body["error_message"]
    status, body = await http_call(lora_engine.url, "/generate",
                                   {"input_ids": PROMPT, "lora_path": ["a", "b"]})
    assert status == 400 and "lora_path" in body["error"]["message"]
