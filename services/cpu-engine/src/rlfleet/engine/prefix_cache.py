"""The KV of finished sequences, kept so that a later request starting with the same tokens prefills
only the rest (SGLang's RadixAttention reuse, in the block-hashed form of vLLM's automatic prefix
caching).

Why: in a multi-turn episode each turn's prompt is the previous turn's prompt + its output + an
observation, and every episode of a task starts with the same system prompt. Without reuse every
turn prefills the whole conversation again, which is where most of the engine's time went.

An entry is one finished sequence: its tokens and, per layer, keys and values
`[1, kv_heads, len, head_dim]` -- compact copies, never views into the running batch's buffer
(a view would keep that whole buffer alive). The index maps a chained hash of every whole block
`tokens[:k]` (k a multiple of `block_size`) to the entry that stored or last used it. A lookup walks
the input's block hashes longest first, checks the tokens themselves (a hash is never trusted alone),
then extends the match token by token inside that entry, so a turn reuses all of the previous turn,
not just its whole blocks. At least one input token is always left over: its logits give the next
token. Lookups cost O(input blocks), inserts O(sequence blocks) plus the copy.

The cache holds at most `max_tokens` tokens (0 turns it off), least recently used out first; a hit
refreshes its entry. Storing a sequence already held (equal to, or a prefix of, an entry) only
refreshes that entry, and entries the new sequence extends (the previous turn of the same episode)
are dropped, since it covers them. KV depends on the weights: the owner clears the cache whenever
they change. Only the scheduler thread touches it, so there is no locking.

KV also depends on the LoRA adapter that computed it (its layers change every key and value after
the first layer): each entry belongs to a namespace -- the adapter's load id, None for the base
model -- which seeds its block hashes and is checked beside its tokens, so a prefix cached under one
adapter is never reused for another, nor for the base model.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch


class PrefixHit(NamedTuple):
    length: int  # tokens whose KV is reused
    keys: list[torch.Tensor]  # per layer `[1, kv_heads, length, head_dim]`, views into the entry
    values: list[torch.Tensor]


@dataclass(eq=False)  # identity semantics: entries are dict keys of the LRU order
class _Entry:
    tokens: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    blocks: list[int]  # its chained block hashes; the index may point some of them elsewhere
    namespace: str | None = None  # the LoRA adapter (load id) whose KV this is; None: the base model


class PrefixCache:
    def __init__(self, max_tokens: int, block_size: int = 16) -> None:
        if max_tokens < 0 or block_size < 1:
            raise ValueError(f"need max_tokens >= 0 and block_size >= 1, got {max_tokens}, {block_size}")
        self.max_tokens = max_tokens
        self.block_size = block_size
        self._lru: OrderedDict[_Entry, None] = OrderedDict()  # least recently used first
        self._index: dict[int, _Entry] = {}
        self.tokens = 0  # held now
        self.lookups = 0
        self.hits = 0
        self.hit_tokens = 0
        self.stored_tokens = 0

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    @property
    def entries(self) -> int:
        return len(self._lru)

    def lookup(self, tokens: Sequence[int], namespace: str | None = None) -> PrefixHit | None:
        """The longest prefix of `tokens` cached in `namespace` that leaves at least one token to
        prefill, or None."""
        if not self.enabled:
            return None
        self.lookups += 1
        tokens = tuple(tokens)
        limit = len(tokens) - 1
        hashes = self._block_hashes(tokens, limit // self.block_size, namespace)
        for blocks in range(len(hashes), 0, -1):
            entry = self._index.get(hashes[blocks - 1])
            length = blocks * self.block_size
            if entry is None or entry.namespace != namespace or entry.tokens[:length] != tokens[:length]:
                continue
            end = min(limit, len(entry.tokens))
            while length < end and entry.tokens[length] == tokens[length]:
                length += 1
            self._lru.move_to_end(entry)
            # The shorter blocks now lead here too, so a shared prefix (a system prompt) stays
            # findable for as long as its most recently used holder lives.
            for key in hashes[:blocks]:
                self._index[key] = entry
            self.hits += 1
            self.hit_tokens += length
            return PrefixHit(
                length,
                [k[:, :, :length] for k in entry.keys],
                [v[:, :, :length] for v in entry.values],
            )
        return None

    def insert(self, tokens: Sequence[int], keys: list[torch.Tensor], values: list[torch.Tensor],
               namespace: str | None = None) -> bool:
        """Stores a copy of the KV of `tokens` (per layer `[1, kv_heads, len(tokens), head_dim]`, any
        strides) computed in `namespace`; returns whether a new entry was made."""
        tokens = tuple(tokens)
        n = len(tokens)
        # Shorter than a block: no lookup could ever find it.
        if not self.enabled or n < self.block_size or n > self.max_tokens:
            return False
        if keys[0].shape[2] != n:
            raise ValueError(f"{n} tokens but KV of {keys[0].shape[2]}")
        hashes = self._block_hashes(tokens, n // self.block_size, namespace)
        holder = self._index.get(hashes[-1])
        if holder is not None and holder.namespace == namespace and holder.tokens[:n] == tokens:
            self._lru.move_to_end(holder)
            return False
        for key in hashes:
            old = self._index.get(key)
            if old is not None and old.namespace == namespace and tokens[: len(old.tokens)] == old.tokens:
                self._remove(old)
        while self._lru and self.tokens + n > self.max_tokens:
            self._remove(next(iter(self._lru)))
        entry = _Entry(
            tokens,
            [k.clone(memory_format=torch.contiguous_format) for k in keys],
            [v.clone(memory_format=torch.contiguous_format) for v in values],
            hashes,
            namespace,
        )
        for key in hashes:
            self._index[key] = entry
        self._lru[entry] = None
        self.tokens += n
        self.stored_tokens += n
        return True

    def clear(self) -> None:
        """Drops every entry; the counters keep counting."""
        self._lru.clear()
        self._index.clear()
        self.tokens = 0

    def drop(self, namespace: str) -> int:
        """Drops the entries of one namespace (an unloaded adapter's); returns how many."""
        gone = [entry for entry in self._lru if entry.namespace == namespace]
        for entry in gone:
            self._remove(entry)
        return len(gone)

    def _remove(self, entry: _Entry) -> None:
        del self._lru[entry]
        self.tokens -= len(entry.tokens)
        for key in entry.blocks:
            if self._index.get(key) is entry:
                del self._index[key]

    def _block_hashes(self, tokens: tuple[int, ...], blocks: int, namespace: str | None = None) -> list[int]:
        """hash(tokens[:k]) for k = block_size, 2 * block_size, ...: each chained on the one before,
        the first on the namespace."""
        hashes, previous, size = [], 0 if namespace is None else hash(namespace), self.block_size
        for block in range(blocks):
            previous = hash((previous, tokens[block * size : (block + 1) * size]))
            hashes.append(previous)
        return hashes
