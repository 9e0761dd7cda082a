"""LoRA adapters served over the one base model, the way SGLang 0.5.23's dynamic LoRA serves them.

An adapter is peft's directory (`adapter_config.json` + `adapter_model.safetensors`), loaded under a
name (`/load_lora_adapter`) and chosen per request by that name (`lora_path` in `/generate`). Its
output on a target linear layer is `W x + (alpha / r) * B (A x)` -- peft's formula, with SGLang's
scaling: `lora_alpha / r`, rsLoRA ignored. The base weights are never copied or changed: each target
`nn.Linear` gets a forward hook that adds the low-rank term for the rows of the batch that use an
adapter, so one batch can mix several adapters and the base model (rows are grouped per adapter,
one `index_add_` per group and layer).

Refused, as SGLang refuses them (with its messages where it has one): DoRA, adapters that add
tokens, a name already loaded; and what this engine cannot serve exactly: target modules that are
not linear layers of the base model, per-module rank/alpha patterns, trained biases, full-module
copies (`modules_to_save`), non-LoRA peft types, Conv1D layouts (`fan_in_fan_out`).

Threads: `read_adapter` (file reading, checks, fp32 tensors) runs in a worker thread; `install` and
`remove` run on the scheduler thread between two steps (the only pause generation sees: a dict
update, plus registering hooks the first time a module is targeted); `batch` is set by the model
runner around each forward pass on the scheduler thread.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


class LoRALoadError(ValueError):
    """An adapter that cannot be served over this base model; nothing was loaded."""


@dataclass(eq=False)  # identity: two loads of one directory are two adapters
class Adapter:
    name: str
    path: str
    rank: int
    scaling: float
    pinned: bool = False
    # module name -> (A `[r, in]`, B `[out, r]` already multiplied by `scaling`), the base's dtype
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Unique per load, as SGLang's lora_id: what the prefix cache keys this adapter's KV by, so a
    # reload under the same name never meets KV of an earlier load.
    lora_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.weights.values())


def read_adapter(path: str | Path, name: str, linears: dict[str, torch.nn.Linear], vocab_size: int,
                 pinned: bool = False) -> Adapter:
    """Reads and checks a peft LoRA directory against the base model's linear layers (by module name)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(path)
    config_file, weights_file = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
    if not directory.is_dir():
        raise LoRALoadError(f"Failed to load LoRA adapter {name}: {path} is not a directory")
    for needed in (config_file, weights_file):
        if not needed.is_file():
            raise LoRALoadError(f"Failed to load LoRA adapter {name}: {path} has no {needed.name} "
                                "(a peft adapter directory holds adapter_config.json and "
                                "adapter_model.safetensors)")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as exc:
        raise LoRALoadError(f"Failed to load LoRA adapter {name}: "
                            f"{ADAPTER_CONFIG} is not JSON ({exc})") from None
    rank, alpha = _check_config(config, name, directory, vocab_size)
    targets = _target_modules(config, linears, name)
    try:
        tensors = load_file(str(weights_file))
    except (SafetensorError, OSError) as exc:
        raise LoRALoadError(f"Failed to load LoRA adapter {name}: {weights_file.name}: {exc}") from None
    scaling = alpha / rank
    adapter = Adapter(name, str(path), rank, scaling, pinned)
    adapter.weights = _pairs(tensors, linears, targets, rank, scaling, name)
    return adapter


def _check_config(config: dict, name: str, directory: Path, vocab_size: int) -> tuple[int, float]:
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRALoadError(f"Failed to load LoRA adapter {name}: "
                            f"peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("use_dora"):
        raise LoRALoadError(f"Failed to load {name} because LoRA serving currently doesn't "
                            "support DoRA adapters")
    if _added_tokens(directory, vocab_size):
        raise LoRALoadError(f"Failed to load {name} because LoRA serving currently doesn't support adapters "
                            "that add tokens to the vocabulary")
    for key, why in (("rank_pattern", "per-module ranks"), ("alpha_pattern", "per-module alphas"),
                     ("modules_to_save", "full copies of modules"),
                     ("layers_to_transform", "a subset of layers")):
        if config.get(key):
            raise LoRALoadError(f"Failed to load LoRA adapter {name}: {key} ({why}) is not supported")
    if config.get("bias", "none") != "none":
        raise LoRALoadError(f"Failed to load LoRA adapter {name}: bias={config['bias']!r} (trained biases) "
                            "is not supported; train with bias='none'")
    if config.get("fan_in_fan_out"):
        raise LoRALoadError(f"Failed to load LoRA adapter {name}: fan_in_fan_out (Conv1D "
                            "layers) is not supported")
    try:
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
    except (KeyError, TypeError, ValueError):
        raise LoRALoadError(f"Failed to load LoRA adapter {name}: {ADAPTER_CONFIG} needs integer 'r' and "
                            "number 'lora_alpha'") from None
    if rank < 1:
        raise LoRALoadError(f"Failed to load LoRA adapter {name}: r must be at least 1, got {rank}")
    return rank, alpha


def _added_tokens(directory: Path, vocab_size: int) -> bool:
    """SGLang's check: added_tokens.json entries at or beyond the base vocabulary are added tokens."""
    file = directory / "added_tokens.json"
    if not file.is_file():
        return False
    try:
        tokens = json.loads(file.read_text())
    except ValueError:
        return False  # SGLang logs an unreadable one and goes on
    return any(int(token_id) >= vocab_size for token_id in tokens.values())


def _target_modules(config: dict, linears: dict[str, torch.nn.Linear], name: str) -> set[str]:
    """The base model's linear layers the config targets, less those it excludes (peft's rule: a
    list names module suffixes, a string is a regex over full module names); refused when a target
    matches no linear layer."""
    targets = config.get("target_modules")
    if isinstance(targets, str):
        matched = _matching(targets, linears)
        if not matched:
            raise LoRALoadError(f"Failed to load LoRA adapter {name}: target_modules {targets!r} matches no "
                                "linear layer of the base model")
    elif isinstance(targets, list) and targets:
        missing = sorted(target for target in targets if not _matching([target], linears))
        if missing:
            raise LoRALoadError(f"Failed to load LoRA adapter {name}: target modules {missing} are not "
                                "linear layers of the base model")
        matched = _matching(targets, linears)
    else:
        raise LoRALoadError(f"Failed to load LoRA adapter {name}: {ADAPTER_CONFIG} has no target_modules")
    excluded = config.get("exclude_modules")
    return matched - _matching(excluded, linears) if excluded else matched


def _matching(spec: str | list[str], modules) -> set[str]:
    """Module names a peft module spec selects: a regex (full match) or a list of name suffixes."""
    import re

    if isinstance(spec, str):
        return {module for module in modules if re.fullmatch(spec, module)}
    return {module for module in modules
            for target in spec if module == target or module.endswith("." + target)}


def _pairs(tensors: dict[str, torch.Tensor], linears: dict[str, torch.nn.Linear], targets: set[str],
           rank: int, scaling: float, name: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(A, scaling * B) per target module, from peft's keys `base_model.model.<module>.lora_{A,B}.weight`."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, _, kind = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if kind not in ("A.weight", "B.weight") or module not in targets:
            raise LoRALoadError(f"Failed to load LoRA adapter {name}: unexpected tensor {key!r} "
                                "(not the lora_A/lora_B weight of a target module)")
        halves.setdefault(module, {})[kind[0]] = tensor
    missing = sorted(targets - set(halves))
    if missing:
        raise LoRALoadError(f"Failed to load LoRA adapter {name}: no weights for target "
                            f"modules {missing[:8]}")
    pairs = {}
    for module, half in sorted(halves.items()):
        if set(half) != {"A", "B"}:
            raise LoRALoadError(f"Failed to load LoRA adapter {name}: {module} has lora_{''.join(half)} only")
        linear = linears[module]
        a, b = half["A"].to(torch.float32), half["B"].to(torch.float32)
        want_a, want_b = (rank, linear.in_features), (linear.out_features, rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise LoRALoadError(f"Failed to load LoRA adapter {name}: {module}: lora_A {list(a.shape)}, "
                                f"lora_B {list(b.shape)}; the base layer and r={rank} "
                                f"need {list(want_a)}, {list(want_b)}")
        # The adapter computes in the base layer's dtype (fp32, or bf16 as SGLang serves it).
        dtype = linear.weight.dtype
        pairs[module] = (a.to(dtype).contiguous(), (b * scaling).to(dtype).contiguous())
    return pairs


class LoRALayers:
    """The loaded adapters of one model and the hooks that apply them."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.linears = {name: module
                        for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
        self.adapters: dict[str, Adapter] = {}
        self._hooked: set[str] = set()
        # Per forward pass: [(adapter, row indices or None for every row)], or None when no row uses one.
        self._groups: list[tuple[Adapter, torch.Tensor | None]] | None = None

    def install(self, adapter: Adapter) -> None:
        """Serves `adapter` under its name (scheduler thread). Refuses a name already loaded."""
        if adapter.name in self.adapters:
            raise LoRALoadError(f"Failed to load LoRA adapter {adapter.name} because it is already loaded")
        for module in adapter.weights:
            if module not in self._hooked:
                self.linears[module].register_forward_hook(self._hook(module))
                self._hooked.add(module)
        self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> Adapter:
        """Stops serving `name` to new requests; requests holding it finish with it (scheduler thread)."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise LoRALoadError(f"LoRA with name {name} does not exist. "
                                f"Loaded LoRAs: {sorted(self.adapters)}")
        return adapter

    def loaded(self) -> dict[str, str]:
        return {name: adapter.path for name, adapter in self.adapters.items()}

    @contextlib.contextmanager
    def batch(self, rows: list[Adapter | None]):
        """Applies each row's adapter (None: the base model) during one forward pass over `rows`."""
        self._groups = _groups(rows)
        try:
            yield
        finally:
            self._groups = None

    def _hook(self, module: str):
        def add_lora(_layer, inputs, output):
            groups = self._groups
            if groups is None:
                return output
            x = inputs[0]
            for adapter, rows in groups:
                pair = adapter.weights.get(module)
                if pair is None:
                    continue
                a, b = pair
                if rows is None:
                    output.add_((x @ a.T) @ b.T)
                else:
                    output.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)
            return output

        return add_lora


def _groups(rows: list[Adapter | None]) -> list[tuple[Adapter, torch.Tensor | None]] | None:
    by_adapter: dict[int, tuple[Adapter, list[int]]] = {}
    for index, adapter in enumerate(rows):
        if adapter is not None:
            by_adapter.setdefault(id(adapter), (adapter, []))[1].append(index)
    if not by_adapter:
        return None
    return [(adapter, None if len(indices) == len(rows) else torch.tensor(indices))
            for adapter, indices in by_adapter.values()]
