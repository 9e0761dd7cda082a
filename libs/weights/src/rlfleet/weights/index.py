"""The per-version index (``rlfleet_index.json``) and the manifest derived from it.

Every version directory, full or delta, has one index. It names the schema
version, the version and its base, the encoding and checksum algorithm, and
per tensor: name, dtype, shape, encoding, compressed size and the checksum of
the full served tensor *at this version*. Unchanged tensors in a delta keep
their checksum too, so one index pins the exact bytes of the whole model; the
manifest's checksum (sha256 of the index file) therefore pins them as well.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

SCHEMA_VERSION = 1
INDEX_FILE = "rlfleet_index.json"
MODEL_FILE = "model.safetensors"
DELTA_FILE = "delta.safetensors"


@dataclass
class TensorEntry:
    name: str
    dtype: str
    shape: list[int]
    checksum: str
    # full checkpoints: "full"; deltas: "xor" | "overwrite" | "none" (unchanged)
    encoding: str = "full"
    layout: str | None = None  # delta: "dense" (whole xor mask) | "sparse" (positions + masks or values)
    changed: int | None = None  # values whose bytes changed since the base version
    compressed_bytes: int | None = None
    position_dtype: str | None = None  # overwrite: uint width of the gap-coded positions
    segments: dict[str, str] = field(default_factory=dict)  # segment -> key in delta.safetensors

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class VersionIndex:
    run_id: str
    version: int
    kind: str  # "full" | "delta" | "adapter" (a LoRA adapter on the full `base_version`: adapter.py)
    served_dtype: str
    checksum: str  # algorithm of the per-tensor checksums
    tensors: list[TensorEntry]
    base_version: int | None = None  # delta: the version it applies to
    full_version: int | None = None  # the full checkpoint this version's chain starts from
    encoding: str | None = None  # delta: "xor" | "overwrite" | "mixed"
    compression: str | None = None  # delta: "zstd" (one frame per segment, content checksum on)
    filter: str | None = None  # delta: "byteshuffle" before compression
    payload: str | None = None  # file holding tensors or segments
    aliases: dict[str, str] = field(default_factory=dict)
    total_bytes: int = 0  # bytes of this version's files (what an engine downloads)
    full_bytes: int = 0  # bytes of all tensors in the served dtype
    changed_values: int | None = None
    total_values: int = 0
    adapter_config_checksum: str | None = None  # adapter: sha256 of adapter_config.json
    # adapter: the adapter version its payload is a delta of (the full deltas' encoding); None: whole
    adapter_parent: int | None = None
    created_at: float = 0.0
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> VersionIndex:
        """Parse and validate; raises ValueError on anything unexpected."""
        try:
            data: dict[str, Any] = json.loads(raw)
            if data.get("schema_version") != SCHEMA_VERSION:
                raise ValueError(f"unsupported schema_version {data.get('schema_version')!r}")
            tensors = [TensorEntry(**t) for t in data.pop("tensors")]
            index = cls(tensors=tensors, **data)
        except (TypeError, KeyError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"malformed index: {e}") from None
        if index.kind not in ("full", "delta", "adapter"):
            raise ValueError(f"unknown kind {index.kind!r}")
        if index.kind in ("delta", "adapter") and index.base_version is None:
            raise ValueError(f"{index.kind} index without base_version")
        return index

    def entries(self) -> dict[str, TensorEntry]:
        return {t.name: t for t in self.tensors}

    def checksums(self) -> dict[str, str]:
        return {t.name: t.checksum for t in self.tensors}
