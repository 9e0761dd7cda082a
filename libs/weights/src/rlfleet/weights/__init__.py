"""rlfleet.weights: the weight store the trainer publishes versions to and engines read from.

Full HF-format checkpoints every K versions, bf16 byte deltas (xor or
overwrite, zstd, per-tensor checksums) in between, or LoRA adapter versions
on a full base (adapter.py); engines fetch and decode a
delta while serving and only swap it in during the pause. No torch import
here: torch helpers live in ``rlfleet.weights.torch_io``.
"""

from rlfleet.weights.adapter import BadAdapter, CorruptAdapter
from rlfleet.weights.config import WeightStoreConfig
from rlfleet.weights.convert import to_served
from rlfleet.weights.delta import ApplyResult, DecodedDelta, apply_delta, preverify_delta
from rlfleet.weights.errors import (
    BaseVersionMismatch,
    CorruptCheckpoint,
    CorruptDelta,
    CorruptVersion,
    PathOutsideStore,
    VersionExists,
    VersionNotFound,
    WeightStoreError,
)
from rlfleet.weights.index import SCHEMA_VERSION, VersionIndex
from rlfleet.weights.store import DirectoryWeightStore, Recovered, WeightStore
from rlfleet.weights.tensors import ServedTensors

__all__ = [
    "SCHEMA_VERSION",
    "ApplyResult",
    "BadAdapter",
    "BaseVersionMismatch",
    "CorruptAdapter",
    "CorruptCheckpoint",
    "CorruptDelta",
    "CorruptVersion",
    "DecodedDelta",
    "DirectoryWeightStore",
    "PathOutsideStore",
    "Recovered",
    "ServedTensors",
    "VersionExists",
    "VersionIndex",
    "VersionNotFound",
    "WeightStore",
    "WeightStoreConfig",
    "WeightStoreError",
    "apply_delta",
    "preverify_delta",
    "to_served",
]
