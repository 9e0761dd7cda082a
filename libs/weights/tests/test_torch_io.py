"""A real (tiny) Qwen2: torch state dicts in, in-place swaps into an engine's
parameters, HF-loadable full checkpoints, and no torch import for light users."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rlfleet.weights import (  # noqa: E402
    DirectoryWeightStore,
    apply_delta,
    preverify_delta,
    torch_io,
)


def tiny_qwen2(seed: int):
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    config = transformers.Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=True,
        max_position_embeddings=128,
    )
    return config, transformers.Qwen2ForCausalLM(config)


def adam_steps(model, n: int, lr: float = 1e-4):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(n):
        ids = torch.randint(0, 256, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        yield model.state_dict()


def test_an_engine_model_swapped_in_place_holds_exactly_the_trainers_bf16_weights(tmp_path):
    _, trainer_model = tiny_qwen2(0)
    store = DirectoryWeightStore(tmp_path, "r", full_every=100)
    store.write_version(0, trainer_model.state_dict())
    index = store.index(0)
    assert index.aliases == {"lm_head.weight": "model.embed_tokens.weight"}  # tied, stored once

    _, engine = tiny_qwen2(1)
    engine = engine.to(torch.bfloat16)
    torch_io.copy_into(engine, store.load_full(0))
    views = torch_io.byte_views(engine)
    for version, sd in enumerate(adam_steps(trainer_model, 3), start=1):
        assert store.write_version(version, sd)["kind"] == "delta"
        decoded = store.fetch_delta(version)
        preverify_delta(views, decoded)
        apply_delta(views, decoded, current_version=version - 1)
    expected = {k: v.to(torch.bfloat16) for k, v in trainer_model.state_dict().items()}
    for name, param in engine.state_dict().items():
        assert torch.equal(param, expected[name]), name
    assert engine.lm_head.weight.data_ptr() == engine.model.embed_tokens.weight.data_ptr()


def test_a_full_checkpoint_loads_with_hf_from_pretrained(tmp_path):
    config, model = tiny_qwen2(0)
    base = tmp_path / "base"
    config.save_pretrained(base)
    store = DirectoryWeightStore(tmp_path / "store", "r", base_dir=base)
    store.write_version(0, model.state_dict())
    loaded = transformers.Qwen2ForCausalLM.from_pretrained(store.path(0), dtype=torch.bfloat16)
    for name, param in loaded.state_dict().items():
        assert torch.equal(param, model.state_dict()[name].to(torch.bfloat16)), name


def test_importing_the_store_does_not_import_torch():
    code = ("import sys, rlfleet.weights, rlfleet.weights.store; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
