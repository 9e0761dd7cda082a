"""Builds a tiny policy: a byte-level BPE tokenizer and a small causal LM of one model family, in HF format.

`rlfleet-build-model --out DIR --seed 0 --corpus FILE` writes `tokenizer.json`, `tokenizer_config.json`,
`special_tokens_map.json`, `config.json`, `generation_config.json` and `model.safetensors`.
`--family` picks the architecture and chat format (`rlfleet.common.families`): `qwen2` (the default
model: ChatML and `<calc>` tags), `qwen3` (Qwen3's architecture, Hermes `<tool_call>` JSON), `llama`
(Llama 3 headers and JSON calls), `mistral` ([INST] turns, `[TOOL_CALLS]`, untied embeddings).
`--dtype bfloat16` saves the weights in bf16, as most Hub checkpoints are.
`transformers.AutoTokenizer`/`AutoModelForCausalLM` and plain `tokenizers.Tokenizer.from_file`
load the result, and so does the CPU engine (and a real SGLang server).

The output is a pure function of (corpus, seed, sizes): the same inputs give bit-identical files,
so a run can name its starting policy by its arguments. The weights are randomly initialised; the
model learns its task through SFT/RL in the loop, not here.

torch, transformers and tokenizers are imported inside functions so that `--help` is instant.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

# The tokenizer format is the chat format's other half, shared with the session server and the
# environment kit's tests: it lives with the chat format, in libs/common.
from rlfleet.common.chat import tokenizer_config, train_tokenizer
from rlfleet.common.families import FAMILIES, QWEN2, Family, family

__all__ = ["ModelSpec", "build", "build_model", "tokenizer_config", "train_tokenizer", "write_tokenizer"]


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of the default model; the defaults give ~3M parameters."""

    vocab_size: int = 768
    hidden_size: int = 256
    intermediate_size: int = 704
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0


def build_model(spec: ModelSpec, vocab_size: int, seed: int, model_family: Family = QWEN2,
                dtype: str = "float32"):
    """A randomly initialised causal LM of `model_family`'s architecture, deterministic from `seed`
    (initialised in fp32, then cast to `dtype`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    ids = {token: index for index, token in enumerate(model_family.special_tokens)}
    eos_ids = [ids[t] for t in model_family.stop_tokens]
    bos_id = ids.get(model_family.bos_token) if model_family.bos_token else None
    settings = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=model_family.tie_word_embeddings,
        bos_token_id=bos_id,
        eos_token_id=eos_ids,
        pad_token_id=ids[model_family.pad_token],
        dtype=dtype,
    )
    if model_family.model_type in ("qwen2", "qwen3"):
        settings["use_sliding_window"] = False
    if model_family.model_type != "qwen2":
        # Qwen3's default head_dim (128) is not hidden/heads; say it for every other family too.
        settings["head_dim"] = spec.hidden_size // spec.num_attention_heads
    if model_family.model_type == "mistral":
        settings["sliding_window"] = None
    config = AutoConfig.for_model(model_family.model_type, **settings)
    # fork_rng keeps the caller's global RNG untouched; the init is a function of the seed only.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(getattr(torch, dtype))
    model.generation_config.eos_token_id = eos_ids
    model.generation_config.pad_token_id = settings["pad_token_id"]
    model.generation_config.bos_token_id = bos_id
    return model.eval()


def write_tokenizer(out: Path, texts: Sequence[str], vocab_size: int, model_max_length: int,
                    model_family: Family = QWEN2):
    """tokenizer.json, tokenizer_config.json (with the family's chat template) and
    special_tokens_map.json in `out`; returns the trained `tokenizers.Tokenizer`."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(texts, vocab_size, model_family.special_tokens, model_family.split_regex)
    tokenizer.save(str(out / "tokenizer.json"))
    config = model_family.tokenizer_config(model_max_length)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    names = ("bos_token", "eos_token", "pad_token", "unk_token", "additional_special_tokens")
    special = {k: config[k] for k in names if config[k] is not None}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2, sort_keys=True) + "\n")
    return tokenizer


def build(out: Path, texts: Sequence[str], seed: int, spec: ModelSpec, model_family: Family = QWEN2,
          dtype: str = "float32") -> Path:
    """Writes tokenizer and model to `out` and returns it."""
    tokenizer = write_tokenizer(out, texts, spec.vocab_size, spec.max_position_embeddings, model_family)
    # The embedding matrix is sized to the trained vocabulary, which can fall short of the
    # requested size on a small corpus.
    model = build_model(spec, tokenizer.get_vocab_size(), seed, model_family, dtype)
    model.save_pretrained(str(out), safe_serialization=True)
    plain = model_family is QWEN2 and dtype == "float32"
    extra = {} if plain else {"family": model_family.name, "dtype": dtype}
    (out / "rlfleet_build.json").write_text(
        json.dumps({"seed": seed, "corpus_texts": len(texts), **asdict(spec), **extra},
                   indent=2, sort_keys=True)
        + "\n"
    )
    return out


def load_corpus(path: Path | None) -> list[str]:
    # The default corpus is the task suites' business (rlfleet.envkit), not the engine's: whoever
    # builds the default model (the launcher, a deploy's model-init) writes it and passes it here.
    if path is None:
        raise SystemExit("--corpus FILE is required (`python -m rlfleet.envkit.corpus --out FILE` writes "
                         "the default one)")
    texts = [line.rstrip("\n") for line in path.read_text(encoding="utf-8").splitlines()]
    texts = [t.replace("\\n", "\n") for t in texts if t.strip()]
    if not texts:
        raise SystemExit("the tokenizer corpus is empty")
    return texts


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    defaults = ModelSpec()
    parser = argparse.ArgumentParser(prog="rlfleet-build-model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory (created)")
    parser.add_argument("--seed", type=int, default=0, help="weight-init seed")
    parser.add_argument(
        "--corpus",
        type=Path,
        default=None,
        help="text file, one text per line (a literal \\n in a line is a newline); "
        "`python -m rlfleet.envkit.corpus --out FILE` writes the default one",
    )
    parser.add_argument("--family", choices=sorted(FAMILIES), default=QWEN2.name,
                        help="architecture, special tokens and chat format (default qwen2)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="dtype of the saved weights (default float32)")
    for name in asdict(defaults):
        value = getattr(defaults, name)
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=type(value), default=value, help=f"default {value}"
        )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    spec = ModelSpec(**{name: getattr(args, name) for name in asdict(ModelSpec())})
    if spec.hidden_size % spec.num_attention_heads or spec.num_attention_heads % spec.num_key_value_heads:
        raise SystemExit("hidden-size must divide by heads, and heads by kv-heads")
    texts = load_corpus(args.corpus)
    out = build(args.out, texts, args.seed, spec, family(args.family), args.dtype)
    print(json.dumps({"out": str(out), "seed": args.seed, "texts": len(texts), "family": args.family}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
