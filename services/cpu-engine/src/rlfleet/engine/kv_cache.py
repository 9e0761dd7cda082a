"""The running batch's KV cache: one left-padded buffer per layer, rows join and leave between steps.

Layout: keys/values of layer l are `[rows, kv_heads, capacity, head_dim]`; row b holds its tokens in
columns `[pad[b], length)` and nothing before. Because rotary embeddings are applied to a key
when it is written (with the row's own position id), where a row sits in the buffer does not change
the attention result: padding columns are masked out and contribute exactly zero.

The object is handed to the HF model as its `cache`; the model only calls `update()` once per layer
per forward, which writes the new columns at `length` and returns the filled prefix. `advance()`
commits the step afterwards, so every layer of one forward writes the same columns.
"""

from __future__ import annotations

import torch


class PaddedKVCache:
    def __init__(self, num_layers: int, rows: int = 1) -> None:
        self.num_layers = num_layers
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0
        self.pad = torch.zeros(rows, dtype=torch.long)

    # --- what the HF model calls ---------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        new = key_states.shape[2]
        end = self.length + new
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if keys is None or values is None or keys.shape[2] < end:
            keys, values = self._grown(keys, values, key_states, end)
            self.keys[layer_idx], self.values[layer_idx] = keys, values
        keys[:, :, self.length : end] = key_states
        values[:, :, self.length : end] = value_states
        return keys[:, :, :end], values[:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    # --- what the scheduler calls ---------------------------------------------------------------
    @classmethod
    def from_prefix(
        cls, keys: list[torch.Tensor], values: list[torch.Tensor], capacity: int
    ) -> PaddedKVCache:
        """A one-row cache whose first columns are a reused prefix's KV (per layer `[1, kv_heads, len,
        head_dim]`), in buffers of `capacity` columns so the rest of the sequence is written in place."""
        cache = cls(len(keys), rows=1)
        length = int(keys[0].shape[2])
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            shape = (1, k.shape[1], max(capacity, length), k.shape[3])
            layer_keys, layer_values = k.new_zeros(shape), v.new_zeros(shape)
            layer_keys[:, :, :length] = k
            layer_values[:, :, :length] = v
            cache.keys[layer], cache.values[layer] = layer_keys, layer_values
        cache.length = length
        return cache

    @property
    def rows(self) -> int:
        return int(self.pad.shape[0])

    def row(self, row: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Views of one row's filled columns `[pad, length)`, per layer `[1, kv_heads, len, head_dim]`."""
        start = int(self.pad[row])
        layers = [self._filled(layer) for layer in range(self.num_layers)]
        keys = [k[row : row + 1, :, start : self.length] for k, _ in layers]
        values = [v[row : row + 1, :, start : self.length] for _, v in layers]
        return keys, values

    def advance(self, new: int) -> None:
        self.length += new

    def decode_inputs(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention mask `[rows, 1, 1, length + 1]` and position ids `[rows, 1]` for one
        new token per row."""
        columns = torch.arange(self.length + 1)
        masked = columns[None, :] < self.pad[:, None]
        mask = torch.zeros(masked.shape, dtype=dtype).masked_fill_(masked, torch.finfo(dtype).min)
        positions = (self.length - self.pad)[:, None]
        return mask[:, None, None, :], positions

    def keep_rows(self, keep: list[int]) -> None:
        """Drops every row not in `keep` (indices in the current order) and trims shared padding."""
        index = torch.tensor(keep, dtype=torch.long)
        self.pad = self.pad.index_select(0, index)
        for layer in range(self.num_layers):
            keys, values = self.keys[layer], self.values[layer]
            if keys is not None and values is not None:
                self.keys[layer] = keys.index_select(0, index)
                self.values[layer] = values.index_select(0, index)
        self._trim()

    def extend(self, other: PaddedKVCache) -> None:
        """Appends the rows of `other` (e.g. a freshly prefilled request) after the current rows."""
        if self.rows == 0 or self.keys[0] is None:
            self.keys, self.values, self.length, self.pad = other.keys, other.values, other.length, other.pad
            return
        length = max(self.length, other.length)
        mine = self._left_padded(length)
        theirs = other._left_padded(length)
        for layer in range(self.num_layers):
            self.keys[layer] = torch.cat([mine[0][layer], theirs[0][layer]], dim=0)
            self.values[layer] = torch.cat([mine[1][layer], theirs[1][layer]], dim=0)
        self.pad = torch.cat([self.pad + (length - self.length), other.pad + (length - other.length)])
        self.length = length

    # --- internals ------------------------------------------------------------------------------
    def _left_padded(self, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This cache's filled columns, shifted right so they end at `length` (zeros before)."""
        shift = length - self.length
        keys, values = [], []
        for layer in range(self.num_layers):
            layer_keys, layer_values = self._filled(layer)
            k = layer_keys[:, :, : self.length]
            v = layer_values[:, :, : self.length]
            if shift:
                k = torch.nn.functional.pad(k, (0, 0, shift, 0))
                v = torch.nn.functional.pad(v, (0, 0, shift, 0))
            keys.append(k)
            values.append(v)
        return keys, values

    def _trim(self) -> None:
        if self.rows == 0:
            self.keys = [None] * self.num_layers
            self.values = [None] * self.num_layers
            self.length = 0
            return
        shared = int(self.pad.min())
        if shared == 0:
            return
        # A view: the remaining capacity after the filled columns stays usable for the next steps.
        for layer in range(self.num_layers):
            keys, values = self.keys[layer], self.values[layer]
            if keys is not None and values is not None:
                self.keys[layer], self.values[layer] = keys[:, :, shared:], values[:, :, shared:]
        self.pad = self.pad - shared
        self.length -= shared

    def _filled(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers of `layer`, which exist once a row is in the cache."""
        keys, values = self.keys[layer], self.values[layer]
        assert keys is not None and values is not None, f"layer {layer} has no KV buffers yet"
        return keys, values

    def _grown(self, keys: torch.Tensor | None, values: torch.Tensor | None, like: torch.Tensor,
               needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Doubling keeps the copies amortised O(1) per generated token.
        capacity = max(needed, 2 * (keys.shape[2] if keys is not None else 0), 64)
        shape = (like.shape[0], like.shape[1], capacity, like.shape[3])
        new_keys = torch.zeros(shape, dtype=like.dtype)
        new_values = torch.zeros(shape, dtype=like.dtype)
        if keys is not None and values is not None:
            new_keys[:, :, : self.length] = keys[:, :, : self.length]
            new_values[:, :, : self.length] = values[:, :, : self.length]
        return new_keys, new_values
