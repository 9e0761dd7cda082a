"""LoRA adapter versions: a base version plus peft's adapter directory.

An adapter version is its own kind of version (``kind = "adapter"`` in its index)::

    <root>/<run_id>/v000012/   adapter_config.json, adapter_model.safetensors, rlfleet_index.json

``base_version`` names the full version it applies to (``full_version`` too). The directory is the
one peft's ``save_pretrained`` writes, so SGLang's LoRA loader and rlfleet's CPU engine load it as
it is; the index pins each tensor's checksum and the config file's, like any version. Only plain
LoRA is accepted: ``lora_A`` / ``lora_B`` of Linear modules, scaling ``lora_alpha / r`` (what
SGLang computes; rsLoRA, DoRA and adapters with extra tokens or embedding adapters are refused).

The merged model (W + lora_alpha / r * B @ A per target, fp32 arithmetic, rounded to the served
dtype) is what ``load_version`` returns for an adapter version, so engines and consumers that want
a plain model get one; ``DirectoryWeightStore.write_merged`` also writes it as an HF directory.
Numpy only: the light services use this without torch.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlfleet.weights.errors import CorruptVersion, WeightStoreError
from rlfleet.weights.tensors import STORAGE_DTYPES, ServedTensors, bf16_bits_to_fp32, fp32_to_bf16_bits

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
_ADAPTER_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")
_REFUSED_CONFIG = {"use_dora": "DoRA", "use_rslora": "rsLoRA"}


class CorruptAdapter(CorruptVersion):
    """An adapter version's files are missing, unreadable or differ from their checksums."""


class BadAdapter(WeightStoreError, ValueError):
    """An adapter that cannot be applied to its base version (names, shapes, kind of adapter)."""


@dataclass(frozen=True)
class Target:
    """One adapted Linear module: its base weight and the adapter's two factors."""

    module: str
    weight: str  # HF name of the base weight
    a: str  # lora_A: [r, in]
    b: str  # lora_B: [out, r]


def config_checksum(raw: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def config_bytes(config: dict[str, Any]) -> bytes:
    return json.dumps(config, indent=2, sort_keys=True).encode()


def targets(names: list[str]) -> list[Target]:
    """The adapted modules named by an adapter's tensors; anything but plain LoRA factors is refused."""
    parts: dict[str, set[str]] = {}
    for name in names:
        m = _ADAPTER_KEY.match(name)
        if m is None:
            raise BadAdapter(f"adapter tensor {name!r} is not a LoRA factor "
                             f"({PEFT_PREFIX}<module>.lora_A.weight / .lora_B.weight)")
        parts.setdefault(m["module"], set()).add(m["part"])
    out = []
    for module, got in sorted(parts.items()):
        if got != {"A", "B"}:
            raise BadAdapter(f"module {module!r} has lora_{''.join(sorted(got))} only")
        prefix = f"{PEFT_PREFIX}{module}"
        out.append(Target(module, f"{module}.weight", f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"))
    return out


def scaling(config: dict[str, Any]) -> float:
    """lora_alpha / r, as SGLang and peft (without rsLoRA) scale the update."""
    return float(config["lora_alpha"]) / float(config["r"])


def check_config(config: dict[str, Any]) -> None:
    for key, what in _REFUSED_CONFIG.items():
        if config.get(key):
            raise BadAdapter(f"{what} adapters are not supported ({key} = true): SGLang serves plain LoRA")
    if config.get("peft_type", "LORA") != "LORA":
        raise BadAdapter(f"peft_type {config.get('peft_type')!r} is not LORA")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), int | float) or config[key] <= 0:
            raise BadAdapter(f"adapter_config.json needs a positive {key!r}, got {config.get(key)!r}")


def check_against_base(adapter: ServedTensors, config: dict[str, Any],
                       base_layout: dict[str, tuple[str, tuple[int, ...]]]) -> list[Target]:
    """The adapter's targets, each checked against the base weight it applies to."""
    check_config(config)
    r = int(config["r"])
    found = targets(list(adapter))
    for t in found:
        if t.weight not in base_layout:
            raise BadAdapter(f"the base version has no {t.weight!r} for the adapter of {t.module!r}")
        _, (out_dim, in_dim) = base_layout[t.weight]
        a, b = adapter[t.a].shape, adapter[t.b].shape
        if tuple(a) != (r, in_dim) or tuple(b) != (out_dim, r):
            raise BadAdapter(f"{t.module}: lora_A {tuple(a)} and lora_B {tuple(b)} do not fit rank {r} on a "
                             f"{(out_dim, in_dim)} weight")
    return found


def to_float32(arr: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return bf16_bits_to_fp32(arr)
    return arr.astype(np.float32)


def from_float32(arr: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return fp32_to_bf16_bits(arr)
    return np.ascontiguousarray(arr.astype(STORAGE_DTYPES[dtype]))


def merge(base: ServedTensors, adapter: ServedTensors, config: dict[str, Any]) -> ServedTensors:
    """Base + adapter as one model in the base's served dtype (fresh arrays; `base` is not changed)."""
    found = check_against_base(adapter, config, base.layout())
    scale = scaling(config)
    arrays = dict(base.arrays)
    for t in found:
        dtype = base.dtypes[t.weight]
        delta = to_float32(adapter[t.b], adapter.dtypes[t.b]) @ to_float32(adapter[t.a], adapter.dtypes[t.a])
        merged = to_float32(base[t.weight], dtype) + np.float32(scale) * delta
        arrays[t.weight] = from_float32(merged, dtype).reshape(base[t.weight].shape)
    return ServedTensors(arrays, base.dtypes, base.aliases)
