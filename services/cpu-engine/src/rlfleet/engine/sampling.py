"""Per-row sampling for a batch of logits, reproducible per request whatever the batch holds.

Every request owns a `torch.Generator` seeded from its `sampling_seed` (or from OS entropy when it
has none) and draws exactly one uniform number from it per sampled token; every operation below is
row-wise. So the tokens a request gets depend only on its own seed, prompt and parameters, not on
which other requests share the step (up to the last-bit differences of a batched matmul).

Log-probs returned with a token are `log_softmax(raw logits)` in fp32: temperature 1, before top-k /
top-p filtering. They are the policy's log-probs, which is what an RL trainer compares against.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

# SGLang treats temperatures below this as greedy (it sets top_k = 1).
GREEDY_EPS = 1e-6


@dataclass
class RowSampler:
    temperature: float
    top_p: float
    top_k: int  # -1 = whole vocabulary
    generator: torch.Generator

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1


def make_generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed if seed is not None else secrets.randbits(63))
    return generator


def sample(logits: torch.Tensor, rows: list[RowSampler]) -> tuple[list[int], list[float]]:
    """Samples one token per row of `logits` `[rows, vocab]`; returns (token ids, raw log-probs)."""
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    stochastic = [i for i, row in enumerate(rows) if not row.greedy]
    if stochastic:
        index = torch.tensor(stochastic, dtype=torch.long)
        chosen = _sample_filtered(logits.index_select(0, index), [rows[i] for i in stochastic])
        tokens = tokens.index_copy(0, index, chosen)
    picked = logprobs.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), picked.tolist()


def _sample_filtered(logits: torch.Tensor, rows: list[RowSampler]) -> torch.Tensor:
    vocab = logits.shape[-1]
    temperature = torch.tensor([row.temperature for row in rows], dtype=logits.dtype)[:, None]
    probs = torch.softmax(logits / temperature, dim=-1)
    # One uniform draw per row from that row's own generator, whatever path the row takes below.
    uniform = torch.cat([torch.rand(1, generator=row.generator, dtype=torch.float64) for row in rows])
    tokens = torch.empty(len(rows), dtype=torch.long)
    # Sorting the vocabulary is the costly part of a step at large batch; rows without top-k/top-p
    # skip it. Which path a row takes depends on its own parameters only.
    filtered = [i for i, row in enumerate(rows) if row.top_k >= 1 or row.top_p < 1.0]
    plain = [i for i, row in enumerate(rows) if not (row.top_k >= 1 or row.top_p < 1.0)]
    if plain:
        index = torch.tensor(plain)
        tokens[index] = _inverse_cdf(
            probs[index], torch.arange(vocab).expand(len(plain), vocab), uniform[index]
        )
    if filtered:
        index = torch.tensor(filtered)
        sorted_probs, sorted_ids = probs[index].sort(dim=-1, descending=True, stable=True)
        top_k = torch.tensor([vocab if rows[i].top_k < 0 else min(rows[i].top_k, vocab) for i in filtered])[
            :, None
        ]
        top_p = torch.tensor([rows[i].top_p for i in filtered], dtype=probs.dtype)[:, None]
        rank = torch.arange(vocab)[None, :]
        # top-p as SGLang does it: drop a token when the mass strictly before it already exceeds
        # p; the most likely token always survives.
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        dropped = (rank >= top_k) | (before > top_p)
        dropped[:, 0] = False
        tokens[index] = _inverse_cdf(sorted_probs.masked_fill(dropped, 0.0), sorted_ids, uniform[index])
    return tokens


def _inverse_cdf(probs: torch.Tensor, ids: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The id at the first position whose cumulative mass exceeds `uniform` x total, per row."""
    cdf = probs.double().cumsum(dim=-1)
    target = (uniform * cdf[:, -1])[:, None]
    # Never a zero-probability (filtered) entry: those do not raise the cdf.
    position = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1)
    return ids.gather(1, position)[:, 0]
