"""A small safetensors reader/writer over numpy arrays.

Why not ``safetensors.numpy``: numpy has no bf16, and its writer copies every
tensor into ``bytes`` first. The format is an 8-byte little-endian header
length, a JSON header (name -> dtype, shape, data_offsets), then the raw bytes;
files written here load with ``safetensors.torch`` / HF ``from_pretrained``.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rlfleet.weights.tensors import STORAGE_DTYPES

_MAX_HEADER = 100 * 1024 * 1024  # same bound as the reference implementation


class SafetensorsFormatError(Exception):
    """The file is truncated or its header is malformed (callers translate it)."""


@dataclass(frozen=True)
class Entry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int


def write_safetensors(
    path: Path,
    tensors: Iterable[tuple[str, str, np.ndarray]],
    metadata: dict[str, str] | None = None,
) -> int:
    """Write ``(name, dtype_name, array)`` triples; returns the file size. Larger
    element types first so every tensor stays aligned (as the reference writer
    does); the caller fsyncs the directory."""
    items = sorted(tensors, key=lambda t: (-t[2].dtype.itemsize, t[0]))
    header: dict[str, object] = {}
    offset = 0
    for name, dtype, arr in items:
        if STORAGE_DTYPES[dtype].itemsize != arr.dtype.itemsize:
            raise ValueError(f"{name}: array dtype {arr.dtype} does not hold {dtype}")
        header[name] = {
            "dtype": dtype,
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, _, arr in items:
            if arr.nbytes:
                f.write(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(raw) + offset


class SafetensorsFile:
    """Reads tensors by name; validates the header against the file size first,
    so a truncated file fails on open rather than with a short read later."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._f = open(path, "rb")
        try:
            self.entries, self.metadata = self._parse_header()
        except BaseException:
            self._f.close()
            raise

    def _parse_header(self) -> tuple[dict[str, Entry], dict[str, str]]:
        size = os.fstat(self._f.fileno()).st_size
        head = self._f.read(8)
        if len(head) < 8:
            raise SafetensorsFormatError(f"{self.path.name}: shorter than a header")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise SafetensorsFormatError(f"{self.path.name}: header length {n} exceeds file size {size}")
        try:
            header = json.loads(self._f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsFormatError(f"{self.path.name}: header is not JSON ({e})") from None
        metadata = header.pop("__metadata__", None) or {}
        entries: dict[str, Entry] = {}
        base = 8 + n
        for name, info in header.items():
            try:
                dtype = info["dtype"]
                shape = tuple(int(s) for s in info["shape"])
                begin, end = (int(o) for o in info["data_offsets"])
                itemsize = STORAGE_DTYPES[dtype].itemsize
            except (KeyError, TypeError, ValueError) as e:
                raise SafetensorsFormatError(f"{self.path.name}: bad header entry {name!r} ({e})") from None
            if (
                end - begin != int(np.prod(shape, dtype=np.int64)) * itemsize
                or base + end > size
                or begin < 0
            ):
                raise SafetensorsFormatError(
                    f"{self.path.name}: {name!r} offsets out of range (file truncated?)"
                )
            entries[name] = Entry(dtype, shape, base + begin, base + end)
        return entries, metadata

    def read(self, name: str) -> np.ndarray:
        """A fresh, writable array holding the tensor's bytes (one read, no extra copy)."""
        e = self.entries[name]
        arr = np.empty(e.shape, dtype=STORAGE_DTYPES[e.dtype])
        self._read_into(arr.reshape(-1).view(np.uint8).data, e.begin, name)
        return arr

    def read_into(self, name: str, out: np.ndarray) -> None:
        """Read the tensor's bytes straight into ``out`` (contiguous, same byte size)."""
        e = self.entries[name]
        if not out.flags.c_contiguous or out.nbytes != e.end - e.begin:
            raise ValueError(f"{name}: target of {out.nbytes} bytes cannot hold {e.end - e.begin}")
        self._read_into(out.reshape(-1).view(np.uint8).data, e.begin, name)

    def read_bytes(self, name: str) -> bytearray:
        e = self.entries[name]
        buf = bytearray(e.end - e.begin)
        self._read_into(memoryview(buf), e.begin, name)
        return buf

    def _read_into(self, buf: memoryview, offset: int, name: str) -> None:
        # Positional reads: threads may share one open file; loop because one
        # read returns at most ~2 GiB on Linux.
        got = 0
        while got < len(buf):
            n = os.preadv(self._f.fileno(), [buf[got:]], offset + got)
            if not n:
                raise SafetensorsFormatError(f"{self.path.name}: short read in {name!r}")
            got += n

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
