"""The default-model builder: deterministic from its seed, loadable by transformers and tokenizers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from rlfleet.common.chat import CHAT_TEMPLATE, END_OF_TEXT, IM_END, IM_START, render_messages
from rlfleet.engine.testing import build_tiny_model, calc_dialogues, write_corpus

FILES = (
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "config.json",
    "generation_config.json",
)


def test_the_same_seed_builds_bit_identical_files_and_another_seed_other_weights(model_dir, tmp_path):
    again = build_tiny_model(tmp_path / "again", seed=1)
    other = build_tiny_model(tmp_path / "other", seed=2)
    for name in FILES:
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name
    assert (other / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (model_dir / "model.safetensors").read_bytes()


def test_the_tokenizer_loads_in_transformers_and_tokenizers_with_the_shared_chat_format(model_dir):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(model_dir))
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert [raw.token_to_id(t) for t in (END_OF_TEXT, IM_START, IM_END)] == [0, 1, 2]
    assert auto.eos_token == END_OF_TEXT and auto.pad_token_id == 0
    assert 256 < len(auto) <= 512
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    messages = [{"role": "system", "content": "calc"}, {"role": "user", "content": "What is 12*(3+4)?"}]
    rendered = auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == render_messages(messages, add_generation_prompt=True)
    for text in [rendered, *calc_dialogues(5, seed=9), "  spaces\tand ünïcödé 😀 <calc>1/0</calc>"]:
        ids = raw.encode(text).ids
        assert auto.encode(text, add_special_tokens=False) == ids
        assert raw.decode(ids, skip_special_tokens=False) == text
    assert raw.encode(rendered).ids[0] == 1  # <|im_start|> is one special token
    digits = [raw.token_to_id("8"), raw.token_to_id("4")]
    answer = raw.encode("<answer>84</answer>").ids
    assert answer == [*raw.encode("<answer>").ids, *digits, *raw.encode("</answer>").ids]


def test_the_model_loads_in_transformers_as_a_small_tied_qwen2(model_dir):
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    assert model.config.model_type == "qwen2" and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert sorted(GenerationConfig.from_pretrained(str(model_dir)).eos_token_id) == [0, 2]
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([[1, 5, 6]])).logits
    assert logits.shape == (1, 3, model.config.vocab_size) and torch.isfinite(logits).all()


def test_help_is_instant_because_the_builder_imports_torch_lazily():
    probe = ("import sys, rlfleet.engine.build_model, rlfleet.engine.main; "
             "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", probe], check=True)
    result = subprocess.run(
        [sys.executable, "-m", "rlfleet.engine.build_model", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--vocab-size" in result.stdout and "--corpus" in result.stdout


@pytest.mark.slow
def test_the_cli_builds_the_default_architecture_from_a_corpus_file(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt", calc_dialogues(200, seed=3))
    out = tmp_path / "model"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "rlfleet.engine.build_model",
            "--out",
            str(out),
            "--corpus",
            str(corpus),
            "--seed",
            "4",
        ],
        check=True,
        capture_output=True,
    )
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"]) == (256, 4, 4)
    assert config["num_key_value_heads"] == 2 and config["max_position_embeddings"] == 1024
    params = sum(v.numel() for v in load_file(str(out / "model.safetensors")).values())
    assert 1_000_000 < params < 10_000_000
