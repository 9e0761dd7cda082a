"""The weight store: the interface, and the directory implementation.

Layout, one directory per run and one per version::

    <root>/<run_id>/v000012/   full:  model.safetensors, config/tokenizer files, rlfleet_index.json
    <root>/<run_id>/v000013/   delta: delta.safetensors (zstd frames as U8 tensors), rlfleet_index.json
    <root>/<run_id>/v000014/   adapter: adapter_config.json, adapter_model.safetensors (peft's LoRA
                               directory), rlfleet_index.json; applies to a full base_version (adapter.py)
    <root>/<run_id>/v000015/   adapter delta: adapter_config.json, delta.safetensors (the full
                               deltas' encoding, against the adapter version adapter_parent)
    <root>/<run_id>/adapters/v000015/   the peft directory of an adapter delta, rebuilt for loaders
    <root>/<run_id>/merged/v000014/   an adapter version merged into its base, written on request
    <root>/<run_id>/.tmp-*     a version being written; never read

A version becomes visible by one rename of a complete, fsynced directory, so
readers never see half a version, and versions are immutable afterwards.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import re
import shutil
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable
from urllib.parse import unquote, urlparse

import numpy as np

from rlfleet.weights import adapter as lora
from rlfleet.weights import writer
from rlfleet.weights.codec import (
    DecodedTensor,
    DecodeError,
    checksum,
    decode_segments,
)
from rlfleet.weights.config import WeightStoreConfig
from rlfleet.weights.convert import to_served
from rlfleet.weights.delta import DecodedDelta, apply_delta, parallel_map
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
from rlfleet.weights.fsutil import confine, staged_dir, write_file
from rlfleet.weights.index import DELTA_FILE, INDEX_FILE, MODEL_FILE, TensorEntry, VersionIndex
from rlfleet.weights.safetensors_io import SafetensorsFile, SafetensorsFormatError
from rlfleet.weights.tensors import (
    STORAGE_DTYPES,
    ServedTensors,
    is_torch_tensor,
    served_dtype_name,
)

log = logging.getLogger(__name__)

_VERSION_DIR = re.compile(r"^v(\d{6,})$")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass
class Recovered:
    """What ``recover`` could rebuild exactly. ``version`` may be older than
    ``requested`` when the chain to it is broken: serve and report ``version``."""

    version: int
    requested: int
    tensors: ServedTensors
    errors: list[WeightStoreError] = field(default_factory=list)


@runtime_checkable
class WeightStore(Protocol):
    """What the trainer writes to and engines read from. A directory is the
    default; an object store implements the same methods (contract tests in
    ``libs/weights/tests`` run against every implementation)."""

    run_id: str

    def write_version(
        self, version: int, tensors: Mapping[str, Any], parent_version: int | None = None
    ) -> dict[str, Any]:
        """Publish a version (full or delta, by policy); returns its manifest."""

    def latest_version(self) -> int | None: ...
    def list_versions(self) -> list[int]: ...
    def index(self, version: int) -> VersionIndex: ...

    def manifest(self, version: int) -> dict[str, Any]:
        """version, kind, base_version, full_version, uri, bytes, checksum (of the index)..."""

    def version_from_uri(self, uri: str) -> int:
        """The version a URI names; ``PathOutsideStore`` for anything outside the store."""

    def load_full(
        self, version: int, verify: bool = True, into: Mapping[str, Any] | None = None
    ) -> ServedTensors: ...

    def load_version(self, version: int) -> ServedTensors:
        """Any version, rebuilt from its full checkpoint and deltas, checksums verified."""

    def fetch_delta(self, version: int) -> DecodedDelta:
        """Read + decompress + decode a delta, for ``apply_delta`` (before the pause)."""

    def recover(self, version: int, allow_older: bool = True) -> Recovered:
        """Exactly-the-trainer's weights after a failed swap."""

    def write_adapter(
        self, version: int, tensors: Mapping[str, Any], config: Mapping[str, Any], base_version: int,
        parent_version: int | None = None,
    ) -> dict[str, Any]:
        """Publish a LoRA adapter version on the full ``base_version`` (adapter.py)."""

    def load_adapter(self, version: int, verify: bool = True) -> tuple[ServedTensors, dict[str, Any]]: ...

    def fetch_adapter(self, version: int) -> Path:
        """The verified peft directory of an adapter version, for an engine's ``/load_lora_adapter``."""


@dataclass
class _Served:
    """The trainer-side memory of the last version written: the bytes engines
    now serve, which the next delta is computed against."""

    version: int
    tensors: ServedTensors
    index: VersionIndex


class DirectoryWeightStore:
    """``WeightStore`` on a local or shared filesystem (NFS, Lustre, a PVC)."""

    def __init__(
        self,
        root: str | Path,
        run_id: str = "default",
        config: WeightStoreConfig | None = None,
        **overrides: Any,
    ) -> None:
        if not _RUN_ID.match(run_id):
            raise PathOutsideStore(run_id, str(root))
        self.root = Path(root).resolve()
        self.run_id = run_id
        base = config or WeightStoreConfig()
        # Re-validate so that overrides are checked like a config file would be.
        self.config = (
            WeightStoreConfig.model_validate({**base.model_dump(), **overrides}) if overrides else base
        )
        self.run_dir = self.root / run_id
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._last_adapter: _Served | None = None  # the last adapter written: the next one's delta base
        self._last: _Served | None = None

    # ------------------------------------------------------------------ paths

    def path(self, version: int) -> Path:
        return self.run_dir / f"v{int(version):06d}"

    def uri(self, version: int) -> str:
        return self.path(version).as_uri()

    def version_from_uri(self, uri: str) -> int:
        """The version a path or ``file://`` URI names; refuses anything that
        resolves (symlinks, ``..``) outside this store's run directory."""
        parsed = urlparse(uri)
        if parsed.scheme not in ("", "file"):
            raise PathOutsideStore(uri, str(self.root))
        p = Path(unquote(parsed.path))
        if not p.is_absolute():
            p = self.run_dir / p
        resolved = confine(p, self.run_dir)
        m = _VERSION_DIR.match(resolved.name)
        if resolved.parent != self.run_dir.resolve() or not m:
            raise VersionNotFound(None, f"{uri!r} does not name a version directory of run {self.run_id}")
        return int(m.group(1))

    def _file(self, version: int, name: str) -> Path:
        # A file inside a version may itself be a symlink planted to escape.
        return confine(self.path(version) / name, self.root)

    # ---------------------------------------------------------------- listing

    def list_versions(self) -> list[int]:
        out = []
        for p in self.run_dir.iterdir():
            m = _VERSION_DIR.match(p.name)
            if m and (p / INDEX_FILE).exists():
                out.append(int(m.group(1)))
        return sorted(out)

    def latest_version(self) -> int | None:
        versions = self.list_versions()
        return versions[-1] if versions else None

    def index(self, version: int) -> VersionIndex:
        return self._read_index(version)[0]

    def _read_index(self, version: int) -> tuple[VersionIndex, bytes]:
        vdir = self.path(version)
        if not vdir.is_dir():
            raise VersionNotFound(version)
        try:
            raw = self._file(version, INDEX_FILE).read_bytes()
        except FileNotFoundError:
            raise VersionNotFound(version, f"{INDEX_FILE} missing") from None
        try:
            index = VersionIndex.from_json(raw)
        except ValueError as e:
            raise CorruptVersion(version, f"{INDEX_FILE}: {e}") from None
        if index.version != version:
            raise CorruptVersion(version, f"{INDEX_FILE} says version {index.version}")
        return index, raw

    def manifest(self, version: int) -> dict[str, Any]:
        """What the trainer announces on POLICY. ``checksum`` is the sha256 of
        the index, which holds every tensor's checksum: it pins the exact
        served bytes of the version."""
        index, raw = self._read_index(version)
        return {
            "schema_version": index.schema_version,
            "run_id": self.run_id,
            "version": version,
            "kind": index.kind,
            "base_version": index.base_version,
            "full_version": index.full_version,
            "encoding": index.encoding,
            "served_dtype": index.served_dtype,
            "uri": self.uri(version),
            "path": str(self.path(version)),
            "bytes": index.total_bytes,
            "full_bytes": index.full_bytes,
            "changed_values": index.changed_values,
            "total_values": index.total_values,
            "checksum": "sha256:" + hashlib.sha256(raw).hexdigest(),
        }

    # ---------------------------------------------------------------- writing

    def write_version(
        self,
        version: int,
        tensors: Mapping[str, Any],
        parent_version: int | None = None,
        *,
        kind: str | None = None,
    ) -> dict[str, Any]:
        """Publish ``tensors`` (torch state dict, numpy dict, or ``ServedTensors``)
        as ``version``, a delta against ``parent_version`` (default: the latest)
        or a full checkpoint, and return its manifest.

        Full when: no parent, ``kind="full"``, ``full_every`` versions since the
        last full, a changed tensor layout, or a delta that would exceed
        ``max_delta_fraction`` of the full size. Deltas are computed on the
        served bytes against the parent's *served* bytes, never on the
        trainer's fp32 values.
        """
        latest = self.latest_version()
        if self.path(version).exists():
            raise VersionExists(version)
        if latest is not None and version <= latest:
            raise ValueError(f"version {version} is not newer than the latest, {latest}")
        served = to_served(tensors, self.config.served_dtype)
        if parent_version is None:
            parent_version = latest
        parent = self._parent(parent_version) if parent_version is not None and kind != "full" else None
        reason = self._full_reason(parent, served, kind)
        index = None
        if reason is None:
            assert parent is not None
            index = self._write_delta(version, served, parent)
            if index is None:
                reason = "delta larger than max_delta_fraction of a full checkpoint"
        if index is None:
            log.info("weights v%d: full checkpoint (%s)", version, reason)
            index = self._write_full(version, served)
        self._last = _Served(version, served, index)
        return self.manifest(version)

    def _parent(self, version: int) -> _Served | None:
        if self._last is not None and self._last.version == version:
            return self._last
        # A restarted trainer: rebuild the served bytes of the parent from the
        # store; if they cannot be rebuilt exactly, the next version is full.
        try:
            return _Served(version, self.load_version(version), self.index(version))
        except (CorruptVersion, VersionNotFound) as e:
            log.warning("weights: parent v%d unreadable (%s); writing a full checkpoint", version, e)
            return None

    def _full_reason(self, parent: _Served | None, served: ServedTensors, kind: str | None) -> str | None:
        if kind == "full":
            return "requested"
        if kind not in (None, "delta"):
            raise ValueError(f"kind must be 'full', 'delta' or None, not {kind!r}")
        if parent is None:
            return "no parent version"
        if parent.index.kind == "adapter":
            return "the parent is an adapter version"
        if parent.tensors.layout() != served.layout():
            return "tensor names, shapes or dtypes changed"
        if kind is None and self._deltas_since_full(parent.index) + 1 >= self.config.full_every:
            return f"full_every={self.config.full_every}"
        return None

    def _deltas_since_full(self, index: VersionIndex) -> int:
        n = 0
        while index.kind == "delta":
            n += 1
            index = self.index(index.base_version)  # type: ignore[arg-type]
        return n

    def _write_full(self, version: int, served: ServedTensors) -> VersionIndex:
        with self._staged(version) as tmp:
            entries, size = writer.write_full(tmp, served, self.config)
            index = self._new_index(
                version, "full", served, entries, size, full_version=version, payload=MODEL_FILE
            )
            write_file(tmp / INDEX_FILE, index.to_json())
        return index

    def _write_delta(self, version: int, served: ServedTensors, parent: _Served) -> VersionIndex | None:
        entries, blobs = writer.encode_delta(parent.tensors, parent.index, served, self.config)
        if sum(e.compressed_bytes or 0 for e in entries) > self.config.max_delta_fraction * served.nbytes:
            return None
        with self._staged(version) as tmp:
            size = writer.write_delta(tmp, blobs)
            index = self._new_index(
                version, "delta", served, entries, size,
                base_version=parent.version, full_version=parent.index.full_version,
                encoding=writer.delta_encoding(entries), compression="zstd", filter="byteshuffle",
                payload=DELTA_FILE, changed_values=sum(e.changed or 0 for e in entries),
            )  # fmt: skip
            write_file(tmp / INDEX_FILE, index.to_json())
        return index

    def _new_index(
        self,
        version: int,
        kind: str,
        served: ServedTensors,
        entries: list[TensorEntry],
        size: int,
        **fields: Any,
    ) -> VersionIndex:
        return VersionIndex(
            run_id=self.run_id, version=version, kind=kind,
            served_dtype=served_dtype_name(self.config.served_dtype),
            checksum=self.config.checksum, tensors=entries, aliases=served.aliases, total_bytes=size,
            full_bytes=served.nbytes, total_values=sum(a.size for a in served.arrays.values()),
            created_at=time.time(), **fields,
        )  # fmt: skip

    @contextmanager
    def _staged(self, version: int) -> Iterator[Path]:
        try:
            with staged_dir(self.path(version)) as tmp:
                yield tmp
        except FileExistsError:
            raise VersionExists(version) from None

    # ---------------------------------------------------------------- reading

    def load_full(
        self, version: int, verify: bool = True, into: Mapping[str, Any] | None = None
    ) -> ServedTensors:
        """A full checkpoint's tensors, each checked against its checksum unless
        ``verify=False``. Fresh writable arrays, or, with ``into`` (an engine's
        tensors: numpy byte views or CPU torch tensors), read straight into
        those buffers: a full reload with no second copy of the model."""
        index = self.index(version)
        if index.kind != "full":
            raise VersionNotFound(version, f"no full checkpoint at this version (it is a {index.kind})")
        targets = None if into is None else _byte_views(into, index)

        def read(f: SafetensorsFile, e: TensorEntry) -> np.ndarray:
            if targets is None:
                return f.read(e.name)
            f.read_into(e.name, targets[e.name])
            return targets[e.name]

        try:
            with SafetensorsFile(self._file(version, MODEL_FILE)) as f:
                for e in index.tensors:
                    got = f.entries.get(e.name)
                    if got is None or got.dtype != e.dtype or list(got.shape) != e.shape:
                        raise CorruptCheckpoint(
                            version, f"{MODEL_FILE} does not match the index", tensor=e.name
                        )
                arrays = parallel_map(lambda e: read(f, e), index.tensors, self.config.workers)
        except FileNotFoundError:
            raise CorruptCheckpoint(version, f"{MODEL_FILE} missing") from None
        except SafetensorsFormatError as e:
            raise CorruptCheckpoint(version, str(e)) from None
        tensors = ServedTensors(
            {e.name: a for e, a in zip(index.tensors, arrays, strict=True)},
            {e.name: e.dtype for e in index.tensors},
            index.aliases,
        )
        if verify:
            self._verify(version, index, tensors, CorruptCheckpoint)
        return tensors

    def _verify(
        self, version: int, index: VersionIndex, tensors: ServedTensors, error: type[CorruptVersion]
    ) -> None:
        def check(e: TensorEntry) -> None:
            got = checksum(tensors[e.name], index.checksum)
            if got != e.checksum:
                raise error(
                    version, f"{index.checksum} {got[:16]} != expected {e.checksum[:16]}", tensor=e.name
                )

        parallel_map(check, index.tensors, self.config.workers)

    def fetch_delta(self, version: int) -> DecodedDelta:
        """Read, decompress and decode a delta: the part of an update an engine
        does while still serving. Raises ``CorruptDelta`` for a missing or
        damaged payload (zstd content checksums catch flipped bytes here)."""
        index = self.index(version)
        if index.kind != "delta":
            raise VersionNotFound(version, f"no delta at this version (it is a {index.kind})")
        assert index.base_version is not None  # a delta's index always names its base
        return self._decode_delta(version, index, index.base_version, CorruptDelta)

    def _decode_delta(self, version: int, index: VersionIndex, base: int,
                      error: type[CorruptVersion]) -> DecodedDelta:
        try:
            with SafetensorsFile(self._file(version, DELTA_FILE)) as f:

                def decode(e: TensorEntry) -> DecodedTensor:
                    try:
                        segs = {seg: f.read_bytes(key) for seg, key in e.segments.items()}
                        positions, values = decode_segments(
                            encoding=e.encoding,
                            changed=e.changed or 0,
                            numel=e.numel,
                            uint=np.dtype(f"u{STORAGE_DTYPES[e.dtype].itemsize}"),
                            segments=segs,
                            position_dtype=e.position_dtype,
                            sparse_below=self.config.sparse_below,
                        )
                    except (DecodeError, KeyError, SafetensorsFormatError) as err:
                        raise error(version, f"{type(err).__name__}: {err}", tensor=e.name) from None
                    return DecodedTensor(
                        e.name,
                        e.dtype,
                        tuple(e.shape),
                        e.encoding,
                        e.changed or 0,
                        e.checksum,
                        positions,
                        values,
                    )

                decoded = parallel_map(decode, index.tensors, self.config.workers)
                payload = sum(e.compressed_bytes or 0 for e in index.tensors)
        except FileNotFoundError:
            raise error(version, f"{DELTA_FILE} missing") from None
        except SafetensorsFormatError as e:
            raise error(version, str(e)) from None
        return DecodedDelta(
            self.run_id,
            version,
            base,
            index.checksum,
            {d.name: d for d in decoded},
            payload,
        )

    def chain(self, version: int) -> list[int]:
        """The versions to read to rebuild ``version``: its full checkpoint first."""
        out = [version]
        index = self.index(version)
        while index.kind == "delta":
            out.append(index.base_version)  # type: ignore[arg-type]
            index = self.index(index.base_version)  # type: ignore[arg-type]
        return out[::-1]

    def load_version(self, version: int) -> ServedTensors:
        """Rebuild any version: the nearest full checkpoint, then each delta in
        order; every tensor is checked against ``version``'s checksums at the end
        (zstd frame checksums guard the steps in between). An adapter version
        comes back merged into its base (both verified)."""
        if self.index(version).kind == "adapter":
            return self.load_merged(version)
        chain = self.chain(version)
        tensors = self.load_full(chain[0], verify=len(chain) == 1)
        for prev, v in itertools.pairwise(chain):
            apply_delta(
                tensors, self.fetch_delta(v), current_version=prev, verify="none", workers=self.config.workers
            )
        if len(chain) > 1:
            self._verify(version, self.index(version), tensors, CorruptDelta)
        return tensors

    def recover(self, version: int, allow_older: bool = True) -> Recovered:
        """Weights that are exactly the trainer's, for an engine whose swap failed.

        Rebuilds ``version`` from its full checkpoint and deltas. If that chain
        is broken (missing or corrupt file) and ``allow_older``, returns the
        newest older version that rebuilds exactly, never a mix: the engine then
        serves and reports ``Recovered.version`` until a good version arrives.
        """
        errors: list[WeightStoreError] = []
        candidates = [version] + (
            [v for v in reversed(self.list_versions()) if v < version] if allow_older else []
        )
        for v in candidates:
            try:
                tensors = self.load_version(v)
            except (CorruptVersion, VersionNotFound) as e:
                errors.append(e)
                log.warning("weights recover: version %d unusable: %s", v, e)
                continue
            return Recovered(v, version, tensors, errors)
        # Nothing rebuilds exactly: surface why the requested version failed.
        raise errors[0]

    # ---------------------------------------------------------------- adapters

    def write_adapter(
        self,
        version: int,
        tensors: Mapping[str, Any],
        config: Mapping[str, Any],
        base_version: int,
        parent_version: int | None = None,
    ) -> dict[str, Any]:
        """Publish a LoRA adapter (peft's tensor names, its adapter_config.json as a dict) as
        ``version``, applying to the full version ``base_version``; returns its manifest.
        ``BadAdapter`` when it does not fit the base (names, shapes, DoRA/rsLoRA). ``parent_version``
        is the trainer's lineage (announced on POLICY). When it is an adapter on the same base with the
        same config, the new one is stored as a delta of it, in the encoding full deltas use (an
        adapter changes in every value each step, but mostly in its low mantissa bits), unless that is
        larger than ``max_delta_fraction`` of the adapter or ``full_every`` deltas have been written
        since a whole adapter; ``fetch_adapter`` rebuilds the peft directory for loaders."""
        latest = self.latest_version()
        if self.path(version).exists():
            raise VersionExists(version)
        if latest is not None and version <= latest:
            raise ValueError(f"version {version} is not newer than the latest, {latest}")
        base_index = self.index(base_version)
        if base_index.kind != "full":
            raise lora.BadAdapter(f"base version {base_version} is a {base_index.kind}, not a full version")
        served = to_served(tensors, self.config.served_dtype)
        config = dict(config)
        lora.check_against_base(served, config,
                                {e.name: (e.dtype, tuple(e.shape)) for e in base_index.tensors})
        raw_config = lora.config_bytes(config)
        parent = self._adapter_parent(parent_version, base_version, raw_config, served)
        index = (self._write_adapter_delta(version, served, raw_config, base_version, parent)
                 if parent else None)
        if index is None:
            index = self._write_adapter_whole(version, served, raw_config, base_version)
        log.info("weights v%d: LoRA adapter on v%d (%d bytes%s)", version, base_version, index.total_bytes,
                 f", a delta of v{index.adapter_parent}" if index.adapter_parent is not None else "")
        self._last = None  # the next full version is written whole (write_version's parent rule)
        self._last_adapter = _Served(version, served, index)
        return self.manifest(version)

    def _adapter_parent(self, parent_version: int | None, base_version: int, raw_config: bytes,
                        served: ServedTensors) -> _Served | None:
        """The adapter version the new one can be a delta of, if any (same base, config and layout)."""
        if parent_version is None:
            return None
        try:
            index = self.index(parent_version)
        except VersionNotFound:
            return None
        if index.kind != "adapter" or index.base_version != base_version:
            return None
        if index.adapter_config_checksum != lora.config_checksum(raw_config):
            return None
        if self._adapter_deltas_since_whole(index) + 1 >= self.config.full_every:
            return None
        if self._last_adapter is not None and self._last_adapter.version == parent_version:
            parent = self._last_adapter
        else:  # a restarted trainer: the parent's bytes from the store; unreadable -> whole
            try:
                parent = _Served(parent_version, self.load_adapter(parent_version)[0], index)
            except (CorruptVersion, VersionNotFound) as e:
                log.warning("weights: parent adapter v%d unreadable (%s); writing it whole",
                            parent_version, e)
                return None
        return parent if parent.tensors.layout() == served.layout() else None

    def _adapter_deltas_since_whole(self, index: VersionIndex) -> int:
        n = 0
        while index.adapter_parent is not None:
            n += 1
            index = self.index(index.adapter_parent)
        return n

    def _write_adapter_delta(self, version: int, served: ServedTensors, raw_config: bytes, base_version: int,
                             parent: _Served) -> VersionIndex | None:
        entries, blobs = writer.encode_delta(parent.tensors, parent.index, served, self.config)
        if sum(e.compressed_bytes or 0 for e in entries) > self.config.max_delta_fraction * served.nbytes:
            return None
        with self._staged(version) as tmp:
            size = writer.write_delta(tmp, blobs)
            write_file(tmp / lora.ADAPTER_CONFIG_FILE, raw_config)
            index = self._new_index(
                version, "adapter", served, entries, size + len(raw_config), base_version=base_version,
                full_version=base_version, adapter_parent=parent.version,
                encoding=writer.delta_encoding(entries),
                compression="zstd", filter="byteshuffle", payload=DELTA_FILE,
                changed_values=sum(e.changed or 0 for e in entries),
                adapter_config_checksum=lora.config_checksum(raw_config),
            )  # fmt: skip
            write_file(tmp / INDEX_FILE, index.to_json())
        return index

    def _write_adapter_whole(self, version: int, served: ServedTensors, raw_config: bytes,
                             base_version: int) -> VersionIndex:
        with self._staged(version) as tmp:
            names = list(served)
            sums = parallel_map(lambda n: checksum(served[n], self.config.checksum), names,
                                self.config.workers)
            size = writer.write_safetensors(
                tmp / lora.ADAPTER_FILE, ((n, served.dtypes[n], served[n]) for n in names),
                metadata={"format": "pt"}
            )
            write_file(tmp / lora.ADAPTER_CONFIG_FILE, raw_config)
            entries = [TensorEntry(name=n, dtype=served.dtypes[n], shape=list(served[n].shape), checksum=c)
                       for n, c in zip(names, sums, strict=True)]  # fmt: skip
            index = self._new_index(
                version, "adapter", served, entries, size + len(raw_config), base_version=base_version,
                full_version=base_version, payload=lora.ADAPTER_FILE,
                adapter_config_checksum=lora.config_checksum(raw_config),
            )  # fmt: skip
            write_file(tmp / INDEX_FILE, index.to_json())
        return index

    def load_adapter(self, version: int, verify: bool = True) -> tuple[ServedTensors, dict[str, Any]]:
        """An adapter version's tensors and adapter_config.json, checked against the index
        (``CorruptAdapter`` on any difference)."""
        index = self.index(version)
        if index.kind != "adapter":
            raise VersionNotFound(version, f"no adapter at this version (it is a {index.kind})")
        if index.adapter_parent is not None:
            return self._load_adapter_delta(version, index, verify)
        try:
            raw_config = self._file(version, lora.ADAPTER_CONFIG_FILE).read_bytes()
            with SafetensorsFile(self._file(version, lora.ADAPTER_FILE)) as f:
                for e in index.tensors:
                    got = f.entries.get(e.name)
                    if got is None or got.dtype != e.dtype or list(got.shape) != e.shape:
                        raise lora.CorruptAdapter(version, f"{lora.ADAPTER_FILE} does not match the index",
                                                  tensor=e.name)  # fmt: skip
                if set(f.entries) != {e.name for e in index.tensors}:
                    raise lora.CorruptAdapter(version,
                                              f"{lora.ADAPTER_FILE} holds tensors the index does not name")
                arrays = {e.name: f.read(e.name) for e in index.tensors}
        except FileNotFoundError as e:
            raise lora.CorruptAdapter(version, f"{Path(e.filename or '?').name} missing") from None
        except SafetensorsFormatError as e:
            raise lora.CorruptAdapter(version, str(e)) from None
        if verify and lora.config_checksum(raw_config) != index.adapter_config_checksum:
            raise lora.CorruptAdapter(version, f"{lora.ADAPTER_CONFIG_FILE} differs from its checksum")
        tensors = ServedTensors(arrays, {e.name: e.dtype for e in index.tensors})
        if verify:
            self._verify(version, index, tensors, lora.CorruptAdapter)
        try:
            config = json.loads(raw_config)
        except ValueError as e:
            raise lora.CorruptAdapter(version, f"{lora.ADAPTER_CONFIG_FILE}: {e}") from None
        return tensors, config

    def _load_adapter_delta(self, version: int, index: VersionIndex,
                            verify: bool) -> tuple[ServedTensors, dict[str, Any]]:
        """An adapter stored as a delta: its parent adapter (rebuilt the same way), then this delta;
        the result is checked against this version's checksums (zstd frame checksums guard the chain)."""
        parent = index.adapter_parent
        assert parent is not None
        tensors, _ = self.load_adapter(parent, verify=False)
        tensors = ServedTensors({k: np.array(v) for k, v in tensors.arrays.items()}, tensors.dtypes)
        try:
            raw_config = self._file(version, lora.ADAPTER_CONFIG_FILE).read_bytes()
        except FileNotFoundError:
            raise lora.CorruptAdapter(version, f"{lora.ADAPTER_CONFIG_FILE} missing") from None
        if lora.config_checksum(raw_config) != index.adapter_config_checksum:
            raise lora.CorruptAdapter(version, f"{lora.ADAPTER_CONFIG_FILE} differs from its checksum")
        decoded = self._decode_delta(version, index, parent, lora.CorruptAdapter)
        if set(decoded.tensors) != set(tensors.arrays):
            raise lora.CorruptAdapter(version, f"the delta names other tensors than adapter v{parent}")
        apply_delta(tensors, decoded, current_version=parent, verify="none", workers=self.config.workers)
        self._verify(version, index, tensors, lora.CorruptAdapter)  # always: it checks the chain too
        try:
            return tensors, json.loads(raw_config)
        except ValueError as e:
            raise lora.CorruptAdapter(version, f"{lora.ADAPTER_CONFIG_FILE}: {e}") from None

    def adapter_path(self, version: int) -> Path:
        """Where ``fetch_adapter`` rebuilds the peft directory of an adapter stored as a delta."""
        return self.run_dir / "adapters" / f"v{int(version):06d}"

    def fetch_adapter(self, version: int) -> Path:
        """The verified peft directory of ``version``, for an engine's ``/load_lora_adapter``
        (``lora_path``): every file is checked against the index first. An adapter stored whole is
        its version directory; one stored as a delta is rebuilt once (atomically) under
        ``<run>/adapters/``, and that copy is checked against the version's checksums on every fetch."""
        index = self.index(version)
        if index.kind != "adapter" or index.adapter_parent is None:
            self.load_adapter(version, verify=True)
            return self.path(version)
        final = self.adapter_path(version)
        if not (final / lora.ADAPTER_FILE).is_file():
            tensors, config = self.load_adapter(version, verify=True)
            final.parent.mkdir(parents=True, exist_ok=True)
            try:
                with staged_dir(final) as tmp:
                    writer.write_safetensors(tmp / lora.ADAPTER_FILE,
                                             ((n, tensors.dtypes[n], tensors[n]) for n in tensors),
                                             metadata={"format": "pt"})  # fmt: skip
                    write_file(tmp / lora.ADAPTER_CONFIG_FILE, lora.config_bytes(config))
            except FileExistsError:
                pass  # another reader got there first: the same bytes
        self._check_rebuilt_adapter(version, index, final)
        return final

    def _check_rebuilt_adapter(self, version: int, index: VersionIndex, path: Path) -> None:
        try:
            raw_config = (path / lora.ADAPTER_CONFIG_FILE).read_bytes()
            with SafetensorsFile(path / lora.ADAPTER_FILE) as f:
                if set(f.entries) != {e.name for e in index.tensors}:
                    raise lora.CorruptAdapter(version, f"rebuilt {lora.ADAPTER_FILE} holds other tensors")
                arrays = {e.name: f.read(e.name) for e in index.tensors}
        except FileNotFoundError as e:
            raise lora.CorruptAdapter(version, f"rebuilt {Path(e.filename or '?').name} missing") from None
        except SafetensorsFormatError as e:
            raise lora.CorruptAdapter(version, f"rebuilt adapter: {e}") from None
        if lora.config_checksum(raw_config) != index.adapter_config_checksum:
            raise lora.CorruptAdapter(version,
                                      f"rebuilt {lora.ADAPTER_CONFIG_FILE} differs from its checksum")
        self._verify(version, index, ServedTensors(arrays, {e.name: e.dtype for e in index.tensors}),
                     lora.CorruptAdapter)  # fmt: skip

    def load_merged(self, version: int) -> ServedTensors:
        """An adapter version merged into its (verified) base: a plain model in the served dtype."""
        tensors, config = self.load_adapter(version)
        base = self.load_version(self.index(version).base_version)  # type: ignore[arg-type]
        return lora.merge(base, tensors, config)

    def merged_path(self, version: int) -> Path:
        return self.run_dir / "merged" / f"v{int(version):06d}"

    def write_merged(self, version: int) -> Path:
        """The merged model of an adapter version as an HF directory (model.safetensors, the base's
        config and tokenizer files, an index of kind full), for consumers that load plain models;
        written once, atomically, under ``<run>/merged/``."""
        final = self.merged_path(version)
        if (final / INDEX_FILE).is_file():
            return final
        index = self.index(version)
        if index.kind != "adapter":
            raise VersionNotFound(version, f"no adapter at this version (it is a {index.kind})")
        merged = self.load_merged(version)
        base_dir = self.path(index.base_version)  # type: ignore[arg-type]
        final.parent.mkdir(parents=True, exist_ok=True)
        cfg = self.config.model_copy(update={"base_dir": None})
        try:
            with staged_dir(final) as tmp:
                entries, size = writer.write_full(tmp, merged, cfg)
                size += writer.copy_base_files(base_dir, tmp, self.config.served_dtype)
                merged_index = self._new_index(version, "full", merged, entries, size, full_version=version,
                                               payload=MODEL_FILE)  # fmt: skip
                write_file(tmp / INDEX_FILE, merged_index.to_json())
        except FileExistsError:
            pass  # another writer got there first: the same bytes
        return final

    # ---------------------------------------------------------------- housekeeping

    def remove_stale_temp(self, older_than_s: float = 3600.0) -> list[Path]:
        """Delete ``.tmp-*`` directories left by writers that crashed."""
        now, removed = time.time(), []
        for p in self.run_dir.glob(".tmp-v*"):
            if now - p.stat().st_mtime > older_than_s:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
        return removed


def _byte_views(tensors: Mapping[str, Any], index: VersionIndex) -> dict[str, np.ndarray]:
    """The engine's buffers for every tensor of ``index``, as numpy views of
    their bytes, checked against the index's dtypes and shapes."""
    views = {}
    for e in index.tensors:
        if e.name not in tensors:
            raise BaseVersionMismatch(
                index.version, None, f"tensor {e.name!r} missing from the target tensors"
            )
        arr = tensors[e.name]
        if is_torch_tensor(arr):
            from rlfleet.weights import torch_io  # lazy: only engines holding torch tensors pay for it

            arr = torch_io.byte_view(arr)
        if arr.dtype.itemsize != STORAGE_DTYPES[e.dtype].itemsize or arr.size != e.numel:
            raise BaseVersionMismatch(
                index.version,
                None,
                f"{e.name}: target is {arr.dtype}{tuple(arr.shape)}, stored {e.dtype}{e.shape}",
            )
        views[e.name] = arr
    return views
