"""Every family `rlfleet-build-model --family` writes loads in transformers and tokenizers as that
family's checkpoints do, and the engine serves it: batched decoding, prefix reuse, log-probs equal
to a full forward pass, its own EOS ids, and weight loads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from rlfleet.common.families import FAMILIES
from rlfleet.engine.model_runner import ModelRunner, read_checkpoint
from rlfleet.engine.protocol import GenerateItem, SamplingSpec
from rlfleet.engine.scheduler import Request, Scheduler
from rlfleet.engine.testing import build_tiny_model, calc_dialogues, write_corpus

MEMBERS = {"qwen3": "float32", "llama": "bfloat16", "mistral": "float32"}
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
CONVERSATION = [
    {"role": "system", "content": "You are a calculator agent."},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": {"expression": "2+3"}}}]},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "<answer>5</answer>"},
    {"role": "user", "content": "And 4*4?"},
]
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Evaluates arithmetic.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]


@pytest.fixture(scope="module", params=sorted(MEMBERS))
def member(request, tmp_path_factory):
    name = request.param
    root = tmp_path_factory.mktemp(f"family-{name}")
    return name, build_tiny_model(root / "a", seed=1, family=name, dtype=MEMBERS[name]), root


@pytest.fixture(scope="module")
def runner(member):
    return ModelRunner(member[1])


def test_the_directory_loads_as_the_family_with_its_own_tokens_and_template(member):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from rlfleet.session.text import load_chat_renderer

    name, model_dir, _ = member
    family = FAMILIES[name]
    auto = AutoTokenizer.from_pretrained(str(model_dir))
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert [raw.token_to_id(t) for t in family.special_tokens] == list(range(len(family.special_tokens)))
    specials = (family.eos_token, family.bos_token, family.pad_token)
    assert (auto.eos_token, auto.bos_token, auto.pad_token) == specials
    rendered = auto.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    renderer = load_chat_renderer(str(model_dir), "auto")
    assert renderer.render(CONVERSATION, add_generation_prompt=True, tools=TOOLS) == rendered
    # Each family's own markers, tool-call format included.
    marker = {"qwen3": '<tool_call>\n{"name": "calc", "arguments": {"expression": "2+3"}}\n'
                       '</tool_call><|im_end|>',
              "llama": '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "calc", "parameters": '
                       '{"expression": "2+3"}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n'
                       '5<|eot_id|>',
              "mistral": '[TOOL_CALLS] [{"name": "calc", "arguments": {"expression": "2+3"}}]</s>'
                         '[TOOL_RESULTS] {"content": "5"}[/TOOL_RESULTS]'}[name]
    assert marker in rendered
    for text in [rendered, *calc_dialogues(3, seed=9), "  spaces\tand ünïcödé 😀 12345 <calc>1/0</calc>"]:
        assert auto.encode(text, add_special_tokens=False) == raw.encode(text, add_special_tokens=False).ids
    assert raw.decode(raw.encode(rendered).ids, skip_special_tokens=False) == rendered

    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURES[name]] and config["dtype"] == MEMBERS[name]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    assert model.config.tie_word_embeddings == family.tie_word_embeddings
    stop_ids = [family.special_tokens.index(t) for t in family.stop_tokens]
    assert GenerationConfig.from_pretrained(str(model_dir)).eos_token_id == stop_ids


def test_batched_decoding_with_prefix_reuse_gives_the_log_probs_of_a_full_forward_pass(runner, member):
    family = FAMILIES[member[0]]
    assert runner.eos_token_ids == {family.special_tokens.index(t) for t in family.stop_tokens}
    base = runner.encode(calc_dialogues(1, seed=4)[0])[:40]  # longer than a prefix-cache block
    items = [GenerateItem(f"r{i}", base + [10 + i] * i,
                          SamplingSpec(max_new_tokens=6 + 3 * i, sampling_seed=i, ignore_eos=True),
                          return_logprob=True)
             for i in range(4)]
    outputs = {}
    scheduler = Scheduler(runner)
    for it in items:  # joining at different steps: rows of different lengths, with padding
        scheduler.submit(Request(it, runner.eos_token_ids, lambda out: outputs.__setitem__(out.rid, out)))
        scheduler.step()
    while len(outputs) < len(items):
        scheduler.step()
    later = GenerateItem("later", [*base, 10],
                         SamplingSpec(max_new_tokens=5, sampling_seed=9, ignore_eos=True),
                         return_logprob=True)
    scheduler.submit(Request(later, runner.eos_token_ids, lambda out: outputs.__setitem__(out.rid, out)))
    while "later" not in outputs:
        scheduler.step()
    assert outputs["later"].cached_tokens > 0
    for it in [*items, later]:
        out = outputs[it.rid]
        assert len(out.output_ids) == it.sampling.max_new_tokens
        with torch.inference_mode():
            logits = runner.model(input_ids=torch.tensor([it.input_ids + out.output_ids])).logits[0].float()
        reference = torch.log_softmax(logits, dim=-1)
        start = len(it.input_ids) - 1
        expected = [reference[start + j, token].item() for j, token in enumerate(out.output_ids)]
        assert max(abs(a - b) for a, b in zip(expected, out.output_logprobs, strict=True)) <= 1e-4, it.rid


def test_weights_of_another_seed_load_into_the_runner_exactly(member):
    name, _, root = member
    other = build_tiny_model(root / "b", seed=2, family=name, dtype=MEMBERS[name])
    runner = ModelRunner(root / "a")
    named = read_checkpoint(other)
    # An untied model (mistral) ships lm_head beside embed_tokens; a tied one only the embedding.
    assert ("lm_head.weight" in dict(named)) == (not FAMILIES[name].tie_word_embeddings)
    runner.load_weights(named)
    fresh = ModelRunner(other)
    for key, tensor in fresh.model.state_dict().items():
        assert torch.equal(runner.model.state_dict()[key], tensor), key


@pytest.mark.slow
def test_the_cli_builds_a_family_in_bf16(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt", calc_dialogues(100, seed=3))
    out = tmp_path / "model"
    subprocess.run([sys.executable, "-m", "rlfleet.engine.build_model", "--out", str(out),
                    "--corpus", str(corpus), "--family", "llama", "--dtype", "bfloat16", "--hidden-size",
                    "64", "--intermediate-size", "128",
                    "--num-hidden-layers", "1", "--vocab-size", "400"], check=True, capture_output=True)
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["dtype"], config["hidden_size"]) == ("llama", "bfloat16", 64)
    assert json.loads((out / "rlfleet_build.json").read_text())["family"] == "llama"
