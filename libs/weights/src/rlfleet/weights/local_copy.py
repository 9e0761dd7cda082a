"""Node-local full copies of store versions, as plain HF directories an unpatched SGLang loads.

SGLang has no load format for rlfleet's byte deltas; it loads full HF checkpoints only (load format
`auto`). A weight agent beside the engine (a sidecar, or the weight broker in broker mode) keeps the
engine's current version as a full local copy. For the next version it fetches and checks the store
delta and applies it to a copy of those tensors, then writes the new version's directory -- all of it
while the engine keeps generating -- so that only the engine's own load of that directory is inside
the pause. A version with no usable delta is rebuilt from the store (`load_version`, every tensor
checked against the trainer's checksums) into a directory the same way.

    copies = LocalCopies(store, root)
    staged = copies.stage_delta(version, held=engine_version)   # or copies.stage_full(version)
    ...  engine: update_weights_from_disk(staged.path, load_format="auto") ...
    copies.commit(staged, holder=engine_id)                      # or copies.discard(staged)

Directories are `<root>/<run_id>/v000013`, shared by the engines that hold the same version and
removed when no engine holds them. No torch here.
"""

from __future__ import annotations

import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rlfleet.weights.delta import preverify_delta
from rlfleet.weights.errors import BaseVersionMismatch, VersionNotFound
from rlfleet.weights.fsutil import staged_dir
from rlfleet.weights.index import MODEL_FILE
from rlfleet.weights.safetensors_io import write_safetensors
from rlfleet.weights.store import DirectoryWeightStore
from rlfleet.weights.tensors import ServedTensors
from rlfleet.weights.writer import copy_base_files


@dataclass
class Staged:
    """A version's full directory, written and checked, not yet loaded by an engine."""

    version: int
    path: Path
    tensors: ServedTensors
    kind: str  # delta (applied to the held copy) | full (rebuilt from the store)
    fetch_s: float  # reading + decoding + checking the delta, or rebuilding the version
    write_s: float  # writing the directory
    payload_bytes: int  # what was read from the store for it
    changed_fraction: float | None = None


class LocalCopies:
    def __init__(self, store: DirectoryWeightStore, root: str | Path) -> None:
        self.store = store
        self.root = Path(root).resolve() / store.run_id
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}  # holder (engine id) -> version its engine loaded from here
        self._tensors: dict[int, ServedTensors] = {}  # version -> its tensors, while a holder has it

    def path(self, version: int) -> Path:
        return self.root / f"v{int(version):06d}"

    def held(self, holder: str) -> int | None:
        with self._lock:
            return self._held.get(holder)

    # --- staging (outside the pause) -------------------------------------------------------------
    def stage_delta(self, version: int, *, holder: str) -> Staged:
        """The store delta `version` applied to the copy `holder` loaded last; raises
        BaseVersionMismatch when that copy is not the delta's base (then stage_full), and
        CorruptDelta / VersionNotFound for a bad or missing delta. Nothing held changes."""
        started = time.perf_counter()
        with self._lock:
            held = self._held.get(holder)
            base = self._tensors.get(held) if held is not None else None
        index = self.store.index(version)
        if index.kind != "delta":
            raise VersionNotFound(version, f"no delta at this version (it is a {index.kind})")
        if base is None or held != index.base_version:
            raise BaseVersionMismatch(index.base_version, held,
                                      f"the local copy of {holder} is version {held}")
        decoded = self.store.fetch_delta(version)
        preverify_delta(base, decoded, workers=self.store.config.workers)  # current + delta == trainer's
        tensors = base.copy()
        # preverify restaged every changed tensor as checked new values; applying them to the copy
        # (not the held buffers) needs no second hash: each result was just hashed in scratch.
        for name, d in decoded.changed.items():
            flat = tensors.arrays[name].reshape(-1)
            assert d.values is not None, f"{name}: a changed tensor without values"
            if d.positions is None:
                flat[:] = d.values.reshape(-1)
            else:
                flat[d.positions] = d.values
        fetched = time.perf_counter()
        self._write(version, tensors)
        return Staged(version, self.path(version), tensors, "delta", fetched - started,
                      time.perf_counter() - fetched, decoded.payload_bytes,
                      decoded.changed_values / max(sum(a.size for a in tensors.arrays.values()), 1))

    def stage_full(self, version: int) -> Staged:
        """Any version rebuilt exactly from the store (full checkpoint + deltas, checked)."""
        started = time.perf_counter()
        tensors = self.store.load_version(version)
        fetched = time.perf_counter()
        self._write(version, tensors)
        return Staged(version, self.path(version), tensors, "full", fetched - started,
                      time.perf_counter() - fetched, tensors.nbytes)

    def _write(self, version: int, tensors: ServedTensors) -> None:
        final = self.path(version)
        if final.exists():
            return  # another engine's copy of the same version: same bytes (both checked)
        full = self.store.chain(version)[0]  # its config and tokenizer files came with the full version
        try:
            with staged_dir(final) as tmp:
                write_safetensors(tmp / MODEL_FILE, ((n, tensors.dtypes[n], tensors[n]) for n in tensors),
                                  metadata={"format": "pt"})
                copy_base_files(self.store.path(full), tmp, self.store.config.served_dtype)
        except FileExistsError:
            pass  # written meanwhile for another engine

    # --- after the engine's load -----------------------------------------------------------------
    def commit(self, staged: Staged, *, holder: str) -> None:
        """`holder`'s engine loaded `staged`: it is that engine's copy now; unheld directories go."""
        with self._lock:
            self._held[holder] = staged.version
            self._tensors[staged.version] = staged.tensors
            self._collect()

    def discard(self, staged: Staged) -> None:
        """The engine did not load it: the directory goes unless some engine holds that version."""
        with self._lock:
            self._collect()

    def forget(self, holder: str) -> None:
        """`holder`'s engine got weights some other way (a broadcast, a restart)."""
        with self._lock:
            self._held.pop(holder, None)
            self._collect()

    def _collect(self) -> None:
        keep = set(self._held.values())
        for version in [v for v in self._tensors if v not in keep]:
            del self._tensors[version]
        for child in self.root.glob("v*"):
            try:
                version = int(child.name[1:])
            except ValueError:
                continue
            if version not in keep:
                shutil.rmtree(child, ignore_errors=True)
