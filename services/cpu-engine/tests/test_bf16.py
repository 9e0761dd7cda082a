"""The engine computing in bf16 (`dtype = "bfloat16"`, as SGLang serves): weights, activations and KV
in bf16, log-probs those of a bf16 forward pass, store loads the served bf16 bytes themselves, LoRA
adapters in the base's dtype.

What bf16 gives up, and the fp32 tests keep: bit-identical outputs whatever the batch around a request
(in bf16 a request batched and alone differed by up to 0.002 in a log-prob; rows of equal length batched
without padding did not), so the comparisons here carry bf16's tolerance."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlfleet.engine.lora import read_adapter
from rlfleet.engine.model_runner import ModelRunner
from rlfleet.engine.server import STORE_ROUTE
from rlfleet.engine.testing import (
    EngineProcess,
    Harness,
    StoreTrainer,
    assert_engine_serves,
    http_call,
    item,
    make_lora_adapter,
    merged_lora_model,
    sampled_items,
    token_logprobs,
)
from rlfleet.weights import DirectoryWeightStore

PROMPT = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59]


@pytest.fixture(scope="module")
def runner16(model_dir):
    return ModelRunner(model_dir, "bfloat16")


def test_a_bf16_engine_samples_with_the_log_probs_of_a_bf16_forward_pass(runner16, runner):
    assert {p.dtype for p in runner16.model.parameters()} == {torch.bfloat16}
    items = sampled_items(runner16, 4)
    harness = Harness(runner16)
    harness.submit(*items)
    outputs = harness.run(len(items))
    bf16_gap, fp32_gap = 0.0, 0.0
    for it in items:
        out = outputs[it.rid]
        sequence = it.input_ids + out.output_ids
        start = len(it.input_ids) - 1
        own = token_logprobs(runner16.model, sequence)[start:]
        fp32 = token_logprobs(runner.model, sequence)[start:]
        bf16_gap = max(bf16_gap, *(abs(a - b) for a, b in zip(own, out.output_logprobs, strict=True)))
        fp32_gap = max(fp32_gap, *(abs(a - b) for a, b in zip(fp32, out.output_logprobs, strict=True)))
    # Its own full pass up to bf16's rounding of a batch's padding; fp32 further off, but the same model.
    assert bf16_gap <= 0.05, bf16_gap
    assert 0 < fp32_gap <= 0.25, fp32_gap


def test_an_adapter_on_a_bf16_engine_computes_in_bf16_and_follows_the_peft_merged_model(runner16, model_dir,
                                                                                         tmp_path):
    path = make_lora_adapter(model_dir, tmp_path / "a", seed=1, rank=4, alpha=8.0)
    adapter = read_adapter(path, "a", runner16.lora.linears, runner16.vocab_size)
    assert {t.dtype for pair in adapter.weights.values() for t in pair} == {torch.bfloat16}
    runner16.lora.install(adapter)
    try:
        logits, _ = runner16.prefill(PROMPT, all_logits=True, adapter=adapter)
    finally:
        runner16.lora.remove("a")
    got = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0].tolist()
    merged = token_logprobs(merged_lora_model(model_dir, path), PROMPT)
    base = token_logprobs(AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval(),
                          PROMPT)
    assert max(abs(g - w) for g, w in zip(got, merged, strict=True)) <= 0.05
    assert max(abs(g - w) for g, w in zip(got, base, strict=True)) > 0.1  # the adapter is what it follows


def test_a_bf16_engine_batches_requests_with_and_without_the_prefix_cache(runner16):
    items = sampled_items(runner16, 3)
    for cache_tokens in (0, 4096):
        harness = Harness(runner16, max_prefix_cache_tokens=cache_tokens)
        harness.submit(*items)
        outputs = harness.run(len(items))
        assert all(len(outputs[it.rid].output_ids) == it.sampling.max_new_tokens for it in items)
    # Second turns (each first turn's prompt and output, then more): their prefix's KV, kept in bf16,
    # is reused.
    again = [item(f"again-{it.rid}", it.input_ids + outputs[it.rid].output_ids + [7, 8], max_new_tokens=4,
                  ignore_eos=True) for it in items]
    harness.submit(*again)
    outputs = harness.run(len(items) * 2)
    assert all(outputs[it.rid].cached_tokens > 0 and len(outputs[it.rid].output_ids) == 4 for it in again)


@pytest.mark.integration
async def test_store_loads_into_a_bf16_engine_are_the_trainers_bf16_bytes_exactly(model_dir, tmp_path):
    store_root = tmp_path / "store"
    trainer = StoreTrainer(model_dir, DirectoryWeightStore(store_root, "run", full_every=100), lr=1e-4)
    trainer.publish()
    for _ in range(2):
        trainer.step()
        trainer.publish()
    engine = EngineProcess(model_dir, tmp_path / "engine", weight_store_root=store_root,
                           dtype="bfloat16").start()
    try:
        url, store = engine.url, trainer.store
        for version, kind in ((1, "full"), (2, "delta"), (3, "delta")):
            status, reply = await http_call(url, STORE_ROUTE, {"model_path": str(store.path(version)),
                                                               "kind": kind})
            assert status == 200 and reply["success"], reply
            await assert_engine_serves(url, trainer.served(version))
        _, out = await http_call(url, "/generate", {"input_ids": PROMPT[:4],
                                                    "sampling_params": {"max_new_tokens": 4}})
        assert out["meta_info"]["weight_version"] == "3" and len(out["output_ids"]) == 4
    finally:
        engine.stop()
