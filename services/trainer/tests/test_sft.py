import json
import subprocess
import sys
import time

import pytest
import torch

from rlfleet.common.chat import IM_END, render_messages
from rlfleet.trainer.sft import encode_messages, load_demonstrations, run_sft
from rlfleet.trainer.testing import tiny_qwen2_config, write_tiny_tokenizer

torch.set_num_threads(1)


def conversation(a: int, b: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You add numbers."},
            {"role": "user", "content": f"What is {a}+{b}?"},
            {"role": "assistant", "content": f"<calc>{a}+{b}</calc>"},
            {"role": "tool", "content": str(a + b)},
            {"role": "assistant", "content": f"<answer>{a + b}</answer>"}]


@pytest.fixture
def model_dir(tmp_path):
    import transformers
    from tokenizers import Tokenizer

    corpus = [render_messages(conversation(a, b), False) for a in range(5) for b in range(5)]
    write_tiny_tokenizer(tmp_path / "model", corpus)
    vocab = Tokenizer.from_file(str(tmp_path / "model" / "tokenizer.json")).get_vocab_size()
    config = transformers.AutoConfig.for_model(**tiny_qwen2_config(vocab_size=vocab))
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def test_loss_mask_covers_exactly_the_assistant_turns(model_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids, mask = encode_messages(conversation(2, 3), tok)
    assert ids == tok.encode(render_messages(conversation(2, 3), False), add_special_tokens=False).ids
    scored = tok.decode([i for i, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False)
    assert scored == f"<calc>2+3</calc>{IM_END}<answer>5</answer>{IM_END}"


def test_sft_lowers_the_loss_on_its_demonstrations(model_dir, tmp_path):
    data = tmp_path / "demos.jsonl"
    lines = [json.dumps({"messages": conversation(a, b)}) for a in range(3) for b in range(3)]
    lines.append(json.dumps({"token_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 1, 1, 1]}))
    data.write_text("\n".join(lines) + "\n")
    progress = []
    metrics = run_sft(str(model_dir), str(data), str(tmp_path / "out"), epochs=4, lr=1e-2,
                      batch_size=4, seed=0, progress=progress.append)
    assert metrics["samples"] == 10 and metrics["steps"] == 12
    # 12 steps: a record at every step (a tenth of them rounds up to one), each epoch's last one among them.
    assert [r["step"] for r in progress] == list(range(1, 13)) and progress[-1]["epoch"] == 4
    assert all(r["steps"] == 12 and r["epochs"] == 4 for r in progress)
    assert metrics["eval_loss_after"] < 0.7 * metrics["eval_loss_before"], metrics
    assert metrics["epoch_losses"][-1] < metrics["epoch_losses"][0]
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert (tmp_path / "out" / "tokenizer.json").is_file()


def test_token_id_demonstrations_default_to_scoring_every_token_but_the_first(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"token_ids": [4, 5, 6]}) + "\n")
    (sample,) = load_demonstrations(data)
    assert sample.loss_mask == [0, 1, 1]


def test_cli_help_is_instant_and_does_not_import_torch():
    start = time.perf_counter()
    code = "import sys; from rlfleet.trainer import sft; sys.argv=['sft', '--help']\n" \
           "try: sft.main()\nexcept SystemExit: pass\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "--model-dir" in out.stdout and out.stdout.strip().endswith("False")
    assert time.perf_counter() - start < 5


@pytest.mark.parametrize("name, closing",
                         [("llama", "<|eot_id|>"), ("qwen3", "<|im_end|>"), ("mistral", "</s>")])
def test_a_model_s_own_template_renders_the_demonstrations_and_the_mask_covers_its_assistant_turns(
        tmp_path, name, closing):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from rlfleet.common.chat import train_tokenizer
    from rlfleet.common.families import FAMILIES
    from rlfleet.trainer.sft import model_template_renderer

    family = FAMILIES[name]
    corpus = [render_messages(conversation(a, b), False) for a in range(5) for b in range(5)]
    tokenizer = train_tokenizer(corpus, 300, family.special_tokens, family.split_regex)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(family.tokenizer_config(512)))
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    messages = conversation(2, 3)[1:]  # Mistral's template moves a system prompt; demos have none
    ids, mask = encode_messages(messages, tok, model_template_renderer(tmp_path))
    expected = AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(
        messages, tokenize=True, add_generation_prompt=False, return_dict=False)
    assert ids == list(expected)
    scored = tok.decode([i for i, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False)
    assert scored == f"<calc>2+3</calc>{closing}<answer>5</answer>{closing}"


def test_the_built_in_chatml_template_keeps_the_built_in_rendering(model_dir):
    from rlfleet.trainer.sft import model_template_renderer

    assert model_template_renderer(model_dir) is None


def test_sft_with_lora_trains_an_adapter_and_saves_it_beside_the_merged_model(model_dir, tmp_path):
    from safetensors.torch import load_file

    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"messages": conversation(a, b)}) for a in range(3)
                              for b in range(3)) + "\n")
    metrics = run_sft(str(model_dir), str(data), str(tmp_path / "out"), epochs=3, lr=1e-2,
                      batch_size=3, seed=0, lora={"rank": 4, "alpha": 8.0})
    assert metrics["eval_loss_after"] < metrics["eval_loss_before"], metrics
    adapter = load_file(tmp_path / "out" / "adapter" / "adapter_model.safetensors")
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    merged = load_file(tmp_path / "out" / "model.safetensors")
    base = load_file(model_dir / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], base[q])  # the adapter merged in
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])  # not a target


def test_scoring_only_the_first_demonstrations_leaves_the_trained_weights_unchanged(
    model_dir, tmp_path, monkeypatch
):
    from safetensors.torch import load_file

    from rlfleet.trainer import sft

    data = tmp_path / "demos.jsonl"
    data.write_text("".join(json.dumps({"messages": conversation(a, b)}) + "\n" for a in range(3)
                            for b in range(3)))
    runs = {}
    for cap in (2, 100):
        monkeypatch.setattr(sft, "EVAL_SAMPLES", cap)
        runs[cap] = run_sft(str(model_dir), str(data), str(tmp_path / f"out-{cap}"), epochs=1, lr=1e-2,
                            batch_size=4, seed=0)
    assert runs[2]["eval_loss_before"] != runs[100]["eval_loss_before"]  # scored on other samples
    trained = [load_file(str(tmp_path / f"out-{cap}" / "model.safetensors")) for cap in (2, 100)]
    assert trained[0].keys() == trained[1].keys()
    assert all(torch.equal(trained[0][name], trained[1][name]) for name in trained[0])
