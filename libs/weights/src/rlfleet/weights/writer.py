"""The trainer side: turning served tensors into a full checkpoint or a delta
inside a staging directory (``store.DirectoryWeightStore`` publishes it)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from rlfleet.weights.codec import EncodedTensor, checksum, encode_tensor
from rlfleet.weights.config import WeightStoreConfig
from rlfleet.weights.delta import parallel_map
from rlfleet.weights.fsutil import write_file
from rlfleet.weights.index import DELTA_FILE, INDEX_FILE, MODEL_FILE, TensorEntry, VersionIndex
from rlfleet.weights.safetensors_io import write_safetensors
from rlfleet.weights.tensors import ServedTensors, uint_view

# Weight files of a base model dir are not copied into full checkpoints: the
# store writes its own model.safetensors in the served dtype.
_WEIGHT_FILES = re.compile(
    r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack)$|.*\.(safetensors|bin)\.index\.json$"
)
_TORCH_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def write_full(tmp: Path, served: ServedTensors, cfg: WeightStoreConfig) -> tuple[list[TensorEntry], int]:
    """model.safetensors (+ the base model's config/tokenizer files) into ``tmp``;
    returns the index entries and the bytes written."""
    names = list(served)
    sums = parallel_map(lambda n: checksum(served[n], cfg.checksum), names, cfg.workers)
    size = write_safetensors(
        tmp / MODEL_FILE, ((n, served.dtypes[n], served[n]) for n in names), metadata={"format": "pt"}
    )
    if cfg.base_dir is not None:
        size += copy_base_files(Path(cfg.base_dir), tmp, cfg.served_dtype)
    entries = [
        TensorEntry(name=n, dtype=served.dtypes[n], shape=list(served[n].shape), checksum=s)
        for n, s in zip(names, sums, strict=True)
    ]
    return entries, size


def copy_base_files(base: Path, tmp: Path, served_dtype: str) -> int:
    """Config and tokenizer files, so a full version is a loadable HF checkpoint;
    config.json's dtype is set to the served one, as ``save_pretrained`` would."""
    size = 0
    for src in sorted(base.iterdir()):
        if not src.is_file() or _WEIGHT_FILES.match(src.name) or src.name == INDEX_FILE:
            continue
        data = src.read_bytes()
        if src.name == "config.json":
            cfg = json.loads(data)
            for key in ("torch_dtype", "dtype"):
                if key in cfg:
                    cfg[key] = _TORCH_DTYPE[served_dtype]
            data = json.dumps(cfg, indent=2, sort_keys=True).encode()
        write_file(tmp / src.name, data)
        size += len(data)
    return size


def encode_delta(
    parent: ServedTensors, parent_index: VersionIndex, served: ServedTensors, cfg: WeightStoreConfig
) -> tuple[list[TensorEntry], list[tuple[str, str, np.ndarray]]]:
    """Per-tensor delta entries and payload blobs (``name/segment`` -> zstd frame)."""
    # Unchanged tensors keep the parent's checksum (no need to hash them again)
    # when the parent used the same algorithm.
    parent_sums = parent_index.checksums() if parent_index.checksum == cfg.checksum else {}

    def encode(name: str) -> tuple[EncodedTensor, str]:
        enc = encode_tensor(uint_view(parent[name]), uint_view(served[name]), cfg.encoding, cfg.zstd_level)
        if enc.encoding == "none" and name in parent_sums:
            return enc, parent_sums[name]
        return enc, checksum(served[name], cfg.checksum)

    names = list(served)
    entries, blobs = [], []
    for name, (enc, digest) in zip(names, parallel_map(encode, names, cfg.workers), strict=True):
        segments = {}
        for seg, frame in enc.segments.items():
            segments[seg] = key = f"{name}/{seg}"
            blobs.append((key, "U8", np.frombuffer(frame, dtype=np.uint8)))
        entries.append(
            TensorEntry(
                name=name,
                dtype=served.dtypes[name],
                shape=list(served[name].shape),
                checksum=digest,
                encoding=enc.encoding,
                layout=enc.layout,
                changed=enc.changed,
                compressed_bytes=enc.compressed_bytes,
                position_dtype=enc.position_dtype,
                segments=segments,
            )
        )
    return entries, blobs


def write_delta(tmp: Path, blobs: list[tuple[str, str, np.ndarray]]) -> int:
    """The payload: every segment as a U8 tensor of one safetensors file, so any
    safetensors tool can list it and a reader fetches each by offset."""
    return write_safetensors(tmp / DELTA_FILE, blobs, metadata={"format": "rlfleet-delta"})


def delta_encoding(entries: list[TensorEntry]) -> str:
    used = {e.encoding for e in entries} - {"none"}
    return used.pop() if len(used) == 1 else ("mixed" if used else "none")
