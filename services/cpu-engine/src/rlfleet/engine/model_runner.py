"""The model side of the engine: an HF causal LM in fp32 or bf16, its tokenizer, forward passes and
weight loads.

bf16 (`dtype = "bfloat16"`) computes as SGLang serves by default: weights, activations and KV in
bf16, so the served bf16 bytes are the parameters themselves. On a CPU with AMX a big matmul runs
~8x faster in bf16, but the default model's engine only ~1.2x (`bench/engine_dtype.py`: small
matmuls, the rest of a step unchanged), and bf16 gives up what fp32 keeps: a request's outputs
bit-identical whatever the batch around it. Logits are returned in fp32 either way.

Only the scheduler thread calls `prefill`, `decode` and `load_weights`, so a weight swap can never
interleave with a forward pass. `weight_epoch` counts weight changes, so that KV kept across steps
(the prefix cache) is never used with weights other than those that computed it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from rlfleet.engine.kv_cache import PaddedKVCache
from rlfleet.engine.lora import Adapter, LoRALayers

log = logging.getLogger(__name__)


# The SGLang load formats (its LoadFormat values) this engine reads from disk: an HF directory of
# safetensors. Any other value is refused with an error (SGLang itself would raise in its scheduler).
LOAD_FORMATS = ("auto", "safetensors")


class WeightLoadError(ValueError):
    """New weights that do not fit the served model; nothing was changed."""


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class ModelRunner:
    def __init__(self, model_path: Path, dtype: str = "float32") -> None:
        from tokenizers import Tokenizer
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.model_path = Path(model_path)
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.dtype = DTYPES[dtype]
        self.model = AutoModelForCausalLM.from_pretrained(
            str(self.model_path), dtype=self.dtype, attn_implementation="sdpa"
        ).eval()
        self.model.requires_grad_(False)
        self.tokenizer = Tokenizer.from_file(str(self.model_path / "tokenizer.json"))
        config = self.model.config
        _check_full_attention(config)
        # Models whose decoder takes a per-layer-type mask mapping (Qwen2/3, Gemma2/3, ...) are given
        # {"full_attention": mask}, which also lets a plain prefill pass None (SDPA's own causal mask);
        # the others (Llama, Mistral, ...) are given the 4D mask itself, which HF uses as it is.
        self._mask_mapping = bool(getattr(config, "layer_types", None))
        self.vocab_size = int(config.vocab_size)
        self.max_position_embeddings = int(config.max_position_embeddings)
        self.num_layers = int(config.num_hidden_layers)
        self.eos_token_ids = frozenset(_eos_ids(self.model_path, config))
        # remove_duplicate=False lists tied weights under both names (embed_tokens and lm_head).
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        self.weight_epoch = 0  # bumped by every weight change (`weights_changed`)
        self.lora = LoRALayers(self.model)  # adapters served over these weights (never copies of them)

    # --- forward passes -------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(
        self, token_ids: list[int], all_logits: bool = False, cached: PaddedKVCache | None = None,
        adapter: Adapter | None = None,
    ) -> tuple[torch.Tensor, PaddedKVCache]:
        """Runs one sequence (with `adapter`, or the base model) and returns logits and its cache. With
        `cached`, a one-row cache holding the KV of the first `cached.length` tokens, only the rest is
        fed (and gets logits): `[fed, vocab]` with `all_logits`, else `[1, vocab]`."""
        start = 0 if cached is None else cached.length
        cache = PaddedKVCache(self.num_layers, rows=1) if cached is None else cached
        fed = token_ids[start:]
        if start == 0 and self._mask_mapping:
            # A dict bypasses HF's mask construction; None lets SDPA apply its own causal mask.
            mask = None
        else:
            # SDPA's is_causal mask is top-left aligned, wrong once there are past keys (and HF would
            # even crop the keys to the query length): spell the causal mask out.
            mask = _causal_mask(start, len(fed), self.dtype)
        with self.lora.batch([adapter]):
            output = self.model(
                input_ids=torch.tensor([fed]),
                attention_mask=self._mask(mask),
                position_ids=torch.arange(start, len(token_ids))[None, :],
                cache=cache,
                use_cache=True,
                logits_to_keep=0 if all_logits else 1,
            )
        cache.advance(len(fed))
        return output.logits[0].float(), cache

    @torch.inference_mode()
    def prefill_rows(
        self,
        sequences: list[list[int]],
        prefixes: list[tuple[list[torch.Tensor], list[torch.Tensor]] | None],
        kept: list[int],
        fed: int,
        adapters: list[Adapter | None] | None = None,
    ) -> tuple[torch.Tensor, PaddedKVCache]:
        """Prefills several sequences in one pass; returns next-token logits `[rows, vocab]` and a
        cache with one row per sequence (ready to join the running batch).

        Row i reuses the first `kept[i]` columns of its cached prefix `prefixes[i]` (per layer keys and
        values `[1, kv_heads, >= kept, head_dim]`) and feeds the rest of its tokens, which must number
        at most `fed`; a row with fewer is left-padded to `fed`. Every row's last token sits in the
        last column, so `logits_to_keep=1` gives each row's next-token logits. Row i runs with
        `adapters[i]` (None or no list: the base model)."""
        rows = len(sequences)
        start = max(kept)
        cache = PaddedKVCache(self.num_layers, rows=rows)
        pad = torch.zeros(rows, dtype=torch.long)
        input_ids = torch.zeros(rows, fed, dtype=torch.long)
        positions = torch.zeros(rows, fed, dtype=torch.long)
        for i, (tokens, keep) in enumerate(zip(sequences, kept, strict=True)):
            new = tokens[keep:]
            if len(new) > fed:
                raise ValueError(f"row {i} has {len(new)} tokens to feed, more than {fed}")
            input_ids[i, fed - len(new) :] = torch.tensor(new)
            positions[i, fed - len(new) :] = torch.arange(keep, len(tokens))
            pad[i] = start - keep if keep else start + fed - len(new)
        for layer in range(self.num_layers):
            like = next((p[0][layer] for p in prefixes if p is not None), None)
            if like is None:
                break  # no row reuses anything: the first update allocates the buffers
            shape = (rows, like.shape[1], start + fed, like.shape[3])
            keys, values = like.new_zeros(shape), like.new_zeros(shape)
            for i, (prefix, keep) in enumerate(zip(prefixes, kept, strict=True)):
                if keep:
                    assert prefix is not None, f"row {i} keeps {keep} columns of no prefix"
                    keys[i, :, start - keep : start] = prefix[0][layer][0, :, :keep]
                    values[i, :, start - keep : start] = prefix[1][layer][0, :, :keep]
            cache.keys[layer], cache.values[layer] = keys, values
        cache.length = start
        cache.pad = pad
        # Row i's query j (column start + j) sees its own columns from pad[i] up to itself; a padding
        # query sees only itself, so no row of the softmax is empty.
        columns = torch.arange(start + fed)[None, None, :]
        query = (start + torch.arange(fed))[None, :, None]
        allowed = (columns >= pad[:, None, None]) & (columns <= query) | (columns == query)
        lowest = torch.finfo(self.dtype).min
        mask = torch.zeros(allowed.shape, dtype=self.dtype).masked_fill_(~allowed, lowest)
        with self.lora.batch(adapters or [None] * rows):
            output = self.model(
                input_ids=input_ids,
                attention_mask=self._mask(mask[:, None]),
                position_ids=positions,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        cache.advance(fed)
        return output.logits[:, -1].float(), cache

    @torch.inference_mode()
    def decode(self, cache: PaddedKVCache, last_tokens: list[int],
               adapters: list[Adapter | None] | None = None) -> torch.Tensor:
        """Feeds one token per row of the running batch (row i with `adapters[i]`; None: the base
        model); returns next-token logits `[rows, vocab]`."""
        mask, positions = cache.decode_inputs(self.dtype)
        with self.lora.batch(adapters or [None] * len(last_tokens)):
            output = self.model(
                input_ids=torch.tensor(last_tokens)[:, None],
                attention_mask=self._mask(mask),
                position_ids=positions,
                cache=cache,
                use_cache=True,
            )
        cache.advance(1)
        return output.logits[:, -1].float()

    def _mask(self, mask: torch.Tensor | None):
        return {"full_attention": mask} if self._mask_mapping else mask

    # --- text -----------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        # encode_batch, not encode: it releases the GIL while it works, so a long text tokenized in
        # a worker thread does not stop the event loop (encode holds the GIL throughout).
        return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def decode_text(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    # --- weights --------------------------------------------------------------------------------
    def check_weights(self, named: Iterable[tuple[str, Sequence[int]]]) -> None:
        """Raises WeightLoadError unless every (name, shape) is a parameter of the served model."""
        unknown, mismatched = [], []
        for name, shape in named:
            param = self._params.get(name)
            if param is None:
                unknown.append(name)
            elif tuple(param.shape) != tuple(shape):
                mismatched.append(f"{name}: got {list(shape)}, model has {list(param.shape)}")
        if unknown:
            raise WeightLoadError(f"unknown parameter names: {', '.join(unknown[:8])}")
        if mismatched:
            raise WeightLoadError(f"shape mismatch: {'; '.join(mismatched[:8])}")

    def weights_changed(self) -> None:
        """Called by every writer of the weights, before it writes: KV computed under an older
        `weight_epoch` must not be reused."""
        self.weight_epoch += 1

    @torch.inference_mode()
    def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """Copies the tensors into the model (cast to its dtype) after checking all of them; returns
        the count."""
        self.check_weights((name, tensor.shape) for name, tensor in named)
        self.weights_changed()
        for name, tensor in named:
            self._params[name].copy_(tensor.to(self.dtype))
        return len(named)

    def prepare_weights(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Outside the pause (raises WeightLoadError): checked, each tensor a fresh copy in the model's
        dtype that the swap adopts as the parameter's storage."""
        self.check_weights((name, tensor.shape) for name, tensor in named)
        return [(name, t.detach().to(self.dtype, copy=True).contiguous()) for name, t in named]

    @torch.inference_mode()
    def adopt_weights(self, prepared: list[tuple[str, torch.Tensor]]) -> int:
        """The pause of a direct update: each parameter takes its prepared buffer (no copy; a tied
        parameter is one object under two names, so both see it)."""
        self.weights_changed()
        for name, tensor in prepared:
            self._params[name].data = tensor
        return len(prepared)

    def parameter(self, name: str) -> torch.Tensor:
        return self._params[name]


def _check_full_attention(config) -> None:
    """The engine's masks are full causal attention: a model with sliding-window layers is refused
    rather than served with the wrong attention."""
    layer_types = getattr(config, "layer_types", None) or []
    sliding = [t for t in layer_types if t != "full_attention"]
    window = getattr(config, "sliding_window", None)
    if not layer_types and window and getattr(config, "use_sliding_window", True):
        sliding = ["sliding_attention"]
    if sliding:
        raise WeightLoadError(f"{config.model_type} model with {sorted(set(sliding))} layers: the CPU engine "
                              "serves full causal attention only (serve it with SGLang)")


def _causal_mask(past: int, new: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask `[1, 1, new, past + new]`: query i (at position past + i) sees keys 0..past + i."""
    keys = torch.arange(past + new)[None, :]
    queries = past + torch.arange(new)[:, None]
    mask = torch.zeros(new, past + new, dtype=dtype).masked_fill_(keys > queries, torch.finfo(dtype).min)
    return mask[None, None]


def read_checkpoint(model_path: Path) -> list[tuple[str, torch.Tensor]]:
    """All tensors of an HF safetensors checkpoint directory (single file or sharded)."""
    from safetensors.torch import load_file

    model_path = Path(model_path)
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {model_path}")
    named: list[tuple[str, torch.Tensor]] = []
    for file in files:
        named.extend(load_file(str(file)).items())
    return named


def _eos_ids(model_path: Path, config) -> set[int]:
    """EOS ids from generation_config.json and config.json (an int or a list in either)."""
    ids: set[int] = set()
    sources = [getattr(config, "eos_token_id", None)]
    generation = model_path / "generation_config.json"
    if generation.exists():
        sources.append(json.loads(generation.read_text()).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return ids
