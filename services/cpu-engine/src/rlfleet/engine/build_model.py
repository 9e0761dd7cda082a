"""Builds the default tiny policy: a byte-level BPE tokenizer and a small Qwen2 model, in HF format.

`rlfleet-build-model --out DIR --seed 0 --corpus FILE` writes `tokenizer.json`, `tokenizer_config.json`,
`special_tokens_map.json`, `config.json`, `generation_config.json` and `model.safetensors`.
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
from rlfleet.common.chat import END_OF_TEXT, IM_END, SPECIAL_TOKENS, tokenizer_config, train_tokenizer


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


def build_model(spec: ModelSpec, vocab_size: int, seed: int):
    """A randomly initialised Qwen2ForCausalLM in fp32, deterministic from `seed`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    eos_ids = [SPECIAL_TOKENS.index(END_OF_TEXT), SPECIAL_TOKENS.index(IM_END)]
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=eos_ids,
        pad_token_id=eos_ids[0],
        dtype="float32",
    )
    # fork_rng keeps the caller's global RNG untouched; the init is a function of the seed only.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = eos_ids
    model.generation_config.pad_token_id = eos_ids[0]
    model.generation_config.bos_token_id = None
    return model.eval()


def build(out: Path, texts: Sequence[str], seed: int, spec: ModelSpec) -> Path:
    """Writes tokenizer and model to `out` and returns it."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(texts, spec.vocab_size)
    tokenizer.save(str(out / "tokenizer.json"))
    config = tokenizer_config(spec.max_position_embeddings)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    special = {k: config[k] for k in ("eos_token", "pad_token", "additional_special_tokens")}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2, sort_keys=True) + "\n")
    # The embedding matrix is sized to the trained vocabulary, which can fall short of the
    # requested size on a small corpus.
    model = build_model(spec, tokenizer.get_vocab_size(), seed)
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "rlfleet_build.json").write_text(
        json.dumps({"seed": seed, "corpus_texts": len(texts), **asdict(spec)}, indent=2, sort_keys=True)
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
    out = build(args.out, texts, args.seed, spec)
    print(json.dumps({"out": str(out), "seed": args.seed, "texts": len(texts)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
