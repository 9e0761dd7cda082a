"""Typed configuration of the weight store (pydantic; importable without torch)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field

from rlfleet.common.config import StrictModel


class WeightStoreConfig(StrictModel):
    served_dtype: Literal["bf16", "fp16", "fp32"] = Field(
        "bf16", description="dtype engines serve; floating trainer tensors are rounded to it"
    )
    full_every: int = Field(
        10, ge=1, description="write a full checkpoint every K versions, deltas in between (1 = always full)"
    )
    encoding: Literal["xor", "overwrite", "auto"] = Field(
        "xor",
        description="delta encoding per tensor: xor (apply once; a dense mask when at least half the "
        "values changed, else positions + masks), overwrite (positions + new values; idempotent, larger), "
        "auto (the smallest of all three, each compressed)",
    )
    checksum: Literal["sha256", "blake2b", "crc32"] = Field(
        "sha256", description="per-tensor checksum of the served bytes"
    )
    zstd_level: int = Field(3, ge=1, le=22, description="zstd level of delta segments")
    max_delta_fraction: float = Field(
        0.5, gt=0, description="write a full checkpoint instead when a delta is larger than this share of it"
    )
    sparse_below: float = Field(
        0.01,
        ge=0,
        le=1,
        description="decode an xor tensor into (positions, masks) when fewer values than this share changed, "
        "else into a dense mask: above ~1% a streaming XOR over the tensor beats a gather/scatter",
    )
    workers: int = Field(
        default_factory=lambda: min(8, os.cpu_count() or 1),
        ge=1,
        description="threads for hashing and (de)compression; zstd and hashlib release the GIL",
    )
    base_dir: Path | None = Field(
        None, description="HF model dir whose config/tokenizer files are copied into full checkpoints"
    )
