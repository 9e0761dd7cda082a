"""From trajectories to model inputs: padding, sequence packing, rank shards and micro-batches.

Every per-token tensor of a `TrainBatch` is laid out `[rows, length]` and *aligned to the target
token*: the value at position t belongs to the prediction of `input_ids[t]` from positions < t.
`seq_ids` says which sample each position holds (-1 for padding), so losses can aggregate per
sequence whatever the layout. Per-sequence arrays (`rewards`, `seq_num_loss_tokens`, ...) are
indexed by sample index and stay global when a batch is cut into rank shards and micro-batches,
which is what makes the loss normalisation exact under gradient accumulation and data parallelism.

Packing relies on transformers (>= 4.54, checked on 5.24) turning `position_ids` that restart at 0
into a block-diagonal mask when `attention_mask` is None, for eager and sdpa attention alike.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class TrainSample:
    """One trajectory exactly as generated (the trainer's view of the `Trajectory` proto)."""

    trajectory_id: str
    group_id: str
    token_ids: list[int]
    rollout_logprobs: list[float]
    loss_mask: list[int]
    reward: float
    # Per token, or the version of the oldest generated span.
    policy_version: int | list[int] = 0

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if n == 0:
            raise ValueError(f"trajectory {self.trajectory_id}: no tokens")
        if len(self.rollout_logprobs) != n or len(self.loss_mask) != n:
            raise ValueError(f"trajectory {self.trajectory_id}: token_ids ({n}), rollout_logprobs "
                             f"({len(self.rollout_logprobs)}) and loss_mask "
                             f"({len(self.loss_mask)}) differ in length")
        if self.loss_mask[0]:
            # Position 0 has no context to be predicted from; a mask there means the producer is broken.
            raise ValueError(f"trajectory {self.trajectory_id}: loss_mask is 1 on the first token")
        if isinstance(self.policy_version, list) and len(self.policy_version) != n:
            raise ValueError(f"trajectory {self.trajectory_id}: per-token policy_version "
                             "has the wrong length")

    @property
    def oldest_policy_version(self) -> int:
        if isinstance(self.policy_version, int):
            return self.policy_version
        generated = [v for v, m in zip(self.policy_version, self.loss_mask, strict=True) if m]
        return min(generated or self.policy_version)


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [R, L] long
    position_ids: torch.Tensor  # [R, L] long, restarting at 0 for each packed sequence
    attention_mask: torch.Tensor | None  # [R, L] (padded layout); None when packed
    seq_ids: torch.Tensor  # [R, L] long, sample index or -1 on padding
    loss_mask: torch.Tensor  # [R, L] float
    rollout_logprobs: torch.Tensor  # [R, L] float
    # Per sequence, indexed by sample index.
    rewards: torch.Tensor  # [S] float64: group centring must see differences past float32's precision
    seq_num_loss_tokens: torch.Tensor  # [S] float
    policy_versions: torch.Tensor  # [S] long, oldest generated span
    seq_rows: torch.Tensor  # [S] long: row holding the sample
    seq_starts: torch.Tensor  # [S] long: its first column
    seq_lengths: torch.Tensor  # [S] long
    group_ids: list[str]
    trajectory_ids: list[str]
    layout: str
    # Filled by the trainer before train_step ([R, L] float), see losses.py.
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    # Global sizes for loss normalisation; unchanged when rows are selected.
    num_seqs: int = 0
    num_loss_tokens: float = 0.0

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def replace(self, **changes) -> TrainBatch:
        return dataclasses.replace(self, **changes)

    def per_token(self, per_seq: torch.Tensor) -> torch.Tensor:
        """Broadcasts a per-sequence value to the positions of its sequence (0 on padding)."""
        valid = self.seq_ids >= 0
        return torch.where(valid, per_seq.to(torch.float32)[self.seq_ids.clamp(min=0)], 0.0)

    def per_sample(self, token_tensor: torch.Tensor) -> list[torch.Tensor]:
        """Cuts an aligned [R, L] tensor back into one 1-D tensor per sample, in sample order."""
        return [token_tensor[r, s:s + n] for r, s, n in
                zip(self.seq_rows.tolist(), self.seq_starts.tolist(), self.seq_lengths.tolist(), strict=True)]

    def select_rows(self, rows: Sequence[int]) -> TrainBatch:
        """A sub-batch of whole rows, trimmed of columns that are padding in all of them."""
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        used = (self.seq_ids[idx] >= 0).any(dim=0).nonzero()
        width = int(used.max()) + 1 if used.numel() else 1
        changes = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor) and value.dim() == 2:
                changes[f.name] = value[idx, :width]
        return self.replace(**changes)


def _per_sequence_fields(samples: Sequence[TrainSample]) -> dict:
    return dict(
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float64),
        seq_num_loss_tokens=torch.tensor([float(sum(s.loss_mask)) for s in samples]),
        policy_versions=torch.tensor([s.oldest_policy_version for s in samples], dtype=torch.long),
        seq_lengths=torch.tensor([len(s.token_ids) for s in samples], dtype=torch.long),
        group_ids=[s.group_id for s in samples],
        trajectory_ids=[s.trajectory_id for s in samples],
        # Sequences without a loss token add nothing and must not dilute per-sequence averages.
        num_seqs=sum(1 for s in samples if any(s.loss_mask)),
        num_loss_tokens=float(sum(sum(s.loss_mask) for s in samples)),
    )


def _fill(rows: list[list[int]], width: int, samples: Sequence[TrainSample], pad_token_id: int) -> dict:
    """Writes the samples into [len(rows), width] tensors; rows[r] lists the samples of row r."""
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_token_id, dtype=torch.long)
    seq_ids = torch.full(shape, -1, dtype=torch.long)
    loss_mask = torch.zeros(shape)
    rollout = torch.zeros(shape)
    position_ids = torch.zeros(shape, dtype=torch.long)
    seq_rows = torch.zeros(len(samples), dtype=torch.long)
    seq_starts = torch.zeros(len(samples), dtype=torch.long)
    for r, members in enumerate(rows):
        col = 0
        for i in members:
            s = samples[i]
            n = len(s.token_ids)
            input_ids[r, col:col + n] = torch.tensor(s.token_ids, dtype=torch.long)
            seq_ids[r, col:col + n] = i
            loss_mask[r, col:col + n] = torch.tensor(s.loss_mask, dtype=torch.float32)
            rollout[r, col:col + n] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
            position_ids[r, col:col + n] = torch.arange(n)
            seq_rows[i], seq_starts[i] = r, col
            col += n
        # Padding gets positions of its own segment so that a packed mask keeps it apart.
        position_ids[r, col:] = torch.arange(width - col)
    return dict(input_ids=input_ids, position_ids=position_ids, seq_ids=seq_ids, loss_mask=loss_mask,
                rollout_logprobs=rollout, seq_rows=seq_rows, seq_starts=seq_starts)


def pad_batch(samples: Sequence[TrainSample], pad_token_id: int = 0) -> TrainBatch:
    """One right-padded row per sample, with a 2-D attention mask."""
    if not samples:
        raise ValueError("cannot build a batch from no samples")
    width = max(len(s.token_ids) for s in samples)
    tensors = _fill([[i] for i in range(len(samples))], width, samples, pad_token_id)
    attention_mask = (tensors["seq_ids"] >= 0).long()
    return TrainBatch(**tensors, attention_mask=attention_mask, layout="padded",
                      **_per_sequence_fields(samples))


def pack_rows(lengths: Sequence[int], pack_length: int) -> list[list[int]]:
    """First-fit decreasing: sample indices per row, each row holding at most pack_length tokens.

    Deterministic (ties broken by sample index); a sample longer than pack_length gets its own row.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = lengths[i]
        slot = next((r for r, f in enumerate(free) if f >= n), None)
        if slot is None:
            rows.append([i])
            free.append(max(pack_length - n, 0))
        else:
            rows[slot].append(i)
            free[slot] -= n
    return rows


def pack_batch(samples: Sequence[TrainSample], pack_length: int | None = None,
               pad_token_id: int = 0) -> TrainBatch:
    """Whole samples concatenated into rows; no attention mask (the model derives it from position ids).

    pack_length None: rows as long as the longest sample. With eager/sdpa attention a packed row
    costs O(length^2) (a dense block-diagonal mask), so rows much longer than the longest sample
    are slower, not faster (see bench/trainer_throughput.py); varlen flash attention has no such cost.
    """
    if not samples:
        raise ValueError("cannot build a batch from no samples")
    lengths = [len(s.token_ids) for s in samples]
    rows = pack_rows(lengths, pack_length or max(lengths))
    width = max(sum(lengths[i] for i in row) for row in rows)
    tensors = _fill(rows, width, samples, pad_token_id)
    return TrainBatch(**tensors, attention_mask=None, layout="packed", **_per_sequence_fields(samples))


def assemble_batch(samples: Sequence[TrainSample], layout: str = "packed", pack_length: int | None = None,
                   pad_token_id: int = 0) -> TrainBatch:
    if layout == "packed":
        return pack_batch(samples, pack_length, pad_token_id)
    if layout == "padded":
        return pad_batch(samples, pad_token_id)
    raise ValueError(f"unknown batch layout {layout!r}; expected 'packed' or 'padded'")


def shard_rows(batch: TrainBatch, rank: int, world_size: int) -> list[int]:
    """The rows this rank trains on: greedy balance of real tokens over ranks, same answer on every rank."""
    tokens = (batch.seq_ids >= 0).sum(dim=1).tolist()
    order = sorted(range(batch.num_rows), key=lambda r: (-tokens[r], r))
    load = [0] * world_size
    mine: list[int] = []
    for r in order:
        target = min(range(world_size), key=lambda k: (load[k], k))
        load[target] += tokens[r]
        if target == rank:
            mine.append(r)
    return sorted(mine)


def micro_batches(batch: TrainBatch, rows: Sequence[int], rows_per_micro_batch: int) -> list[TrainBatch]:
    return [batch.select_rows(rows[i:i + rows_per_micro_batch])
            for i in range(0, len(rows), rows_per_micro_batch)]


def split_mini_batches(batch: TrainBatch, num: int) -> list[TrainBatch]:
    """Cuts a batch into `num` row-disjoint batches, each normalised on its own.

    For several optimizer steps on one batch (PPO-style epochs/mini-batches): keep `old_logprobs`
    from before the first step and call train_step on each piece.
    """
    if not 1 <= num <= batch.num_rows:
        raise ValueError(f"cannot cut {batch.num_rows} rows into {num} mini-batches")
    bounds = [round(i * batch.num_rows / num) for i in range(num + 1)]
    out = []
    for lo, hi in itertools.pairwise(bounds):
        part = batch.select_rows(range(lo, hi))
        present = part.seq_ids[part.loss_mask > 0].unique()
        out.append(part.replace(num_loss_tokens=float(part.loss_mask.sum()), num_seqs=int(present.numel())))
    return out
