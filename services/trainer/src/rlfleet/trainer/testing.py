"""Tiny models, tokenizers and trajectories for tests, benchmarks and smoke runs (no downloads)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from rlfleet.trainer.batching import TrainSample


def tiny_qwen2_config(vocab_size: int = 64, hidden_size: int = 32, layers: int = 2, heads: int = 4,
                      kv_heads: int = 2, intermediate_size: int | None = None) -> dict[str, Any]:
    return dict(model_type="qwen2", vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads,
                intermediate_size=intermediate_size or 2 * hidden_size, max_position_embeddings=4096,
                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def make_samples(num_groups: int, group_size: int, lengths: tuple[int, int] = (6, 12), vocab_size: int = 64,
                 seed: int = 0, observation: bool = True) -> list[TrainSample]:
    """Random multi-turn-shaped trajectories: prompt, generated span, observation, generated span.

    Rewards alternate within a group so that group-normalised advantages are never all zero.
    """
    rng = random.Random(seed)
    samples = []
    for g in range(num_groups):
        prompt = [rng.randrange(3, vocab_size) for _ in range(rng.randint(2, 4))]
        for k in range(group_size):
            n = rng.randint(*lengths)
            tokens = prompt + [rng.randrange(3, vocab_size) for _ in range(max(n - len(prompt), 2))]
            mask = [0] * len(prompt) + [1] * (len(tokens) - len(prompt))
            if observation and len(tokens) - len(prompt) >= 6:
                # Mark a tool observation in the middle: not generated, no loss.
                mid = len(prompt) + 2
                mask[mid:mid + 2] = [0, 0]
            logprobs = [-rng.uniform(0.5, 4.0) if m else 0.0 for m in mask]
            samples.append(TrainSample(trajectory_id=f"t{g}-{k}", group_id=f"g{g}", token_ids=tokens,
                                       rollout_logprobs=logprobs, loss_mask=mask, reward=float(k % 2),
                                       policy_version=0))
    return samples


def write_tiny_tokenizer(out_dir: str | Path, corpus: list[str], vocab_size: int = 300) -> Path:
    """Trains a byte-level BPE with the chat special tokens and writes tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from rlfleet.common.chat import SPECIAL_TOKENS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    path = Path(out_dir) / "tokenizer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path
