"""Weight loads from the rlfleet weight store: `POST /rlfleet/update_weights_from_store`,
`kind` delta or full.

An rlfleet-only route (SGLang has no load format for store deltas; its `update_weights_from_disk`
takes SGLang's own formats only, and so does this engine's), with `model_path` = a version directory
of a `DirectoryWeightStore` (`<root>/<run_id>/v000013`, or its `file://` URI):

* `delta`: the version must be a delta whose base version the engine holds. The delta is
  fetched (read + decompress + decode), preverified (current + delta == the trainer's checksums,
  on scratch copies) and staged for the model's dtype in a worker thread while the engine keeps
  generating; the pause covers only the swap (an in-place scatter per sparsely changed tensor, a
  buffer swap per densely changed one), and the served bytes follow with `apply_delta` after it.
* `full`: any version, rebuilt from its full checkpoint and the deltas after it
  (`store.load_version`), every tensor checked against the trainer's checksums before it is
  copied in. This is the fallback when a delta is refused, and what a new or lagging engine gets.

The engine computes in fp32 (or bf16) and serves the store's dtype (bf16): it keeps the served bytes
of the version it holds (`served`, half the size of the fp32 model) so that a delta can be
preverified and applied exactly, and mirrors each swap into the parameters (bf16 -> fp32 is exact,
bf16 -> bf16 a copy). After a store load the weights are exactly the trainer's bf16 weights. Any
other kind of update (a plain checkpoint, a broadcast) makes the engine forget which store version
it holds, so the next store update must be a full one -- unless it was a trainer-sent version
flipped in from staging whose checksums are the store's own for that version (`adopt_sent`): its
bytes are then that store version's, and the next version can come as a delta (the fallback of a
failed transfer). A version flipped in before the store had it is kept with its checksums
(`keep_sent`) and adopted once the store has it (`adopt`, `POST /rlfleet/adopt_store_version`).

Every failure before the swap leaves the weights and the weight version untouched and is reported
as a `StoreLoadError` with the reason (400).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

import numpy as np
import torch

from rlfleet.engine.model_runner import ModelRunner
from rlfleet.weights import (
    ApplyResult,
    CorruptVersion,
    DecodedDelta,
    DirectoryWeightStore,
    PathOutsideStore,
    ServedTensors,
    VersionNotFound,
    WeightStoreConfig,
    WeightStoreError,
    apply_delta,
    preverify_delta,
)
from rlfleet.weights.fsutil import confine
from rlfleet.weights.index import INDEX_FILE
from rlfleet.weights.tensors import STORAGE_DTYPES

log = logging.getLogger(__name__)



class StoreLoadError(Exception):
    """A store load refused before anything changed; the message says why."""


@dataclass(frozen=True)
class VersionRef:
    store: DirectoryWeightStore
    version: int

    @property
    def key(self) -> tuple[Path, int]:
        return self.store.run_dir, self.version


@dataclass
class PreparedDelta:
    """A delta ready to swap: decoded and preverified, and staged for the fp32 model as scatters
    (positions + fp32 values) for sparsely changed tensors and whole new fp32 tensors for densely
    changed ones (swapped in by reference: the pause does no conversion and no full-tensor copy)."""

    ref: VersionRef
    decoded: DecodedDelta
    fetch_s: float
    preverify_s: float
    stage_s: float
    changed_fraction: float
    scatters: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (parameter, flat index, values)
    replacements: list[tuple[torch.nn.Parameter, torch.Tensor]]  # (parameter, its new data)

    @property
    def payload_bytes(self) -> int:
        return self.decoded.payload_bytes

@dataclass(frozen=True)
class SentCopy:
    """A trainer-sent version's served bytes and the trainer's checksums of them."""

    tensors: dict[str, torch.Tensor]
    checksums: dict[str, str]
    algorithm: str


@dataclass
class PreparedFull:
    ref: VersionRef
    tensors: ServedTensors
    load_s: float
    bytes_read: int


class StoreWeights:
    """The store version the engine holds, and the two store load paths.

    `prepare_*` run in worker threads and never write the model; `swap_delta`/`install_full` run on
    the scheduler thread, between two decode steps. The server serialises weight updates, so the
    held version cannot change between a prepare and its swap.
    """

    def __init__(self, runner: ModelRunner, root: Path | None = None, workers: int = 1) -> None:
        self.runner = runner
        self.root = None if root is None else Path(root).resolve()
        self.store_config = WeightStoreConfig(workers=workers)
        self.served: ServedTensors | None = None
        self.held: tuple[Path, int] | None = None  # (run dir, version) of the exact bytes served
        self.sent: SentCopy | None = None  # a trainer-sent version's bytes, until the store's copy is adopted
        self._stores: dict[Path, DirectoryWeightStore] = {}

    # --- what is held ---------------------------------------------------------------------------
    def forget(self) -> None:
        """Another kind of update replaced the weights: no store version is held any more."""
        self.served, self.held, self.sent = None, None, None

    @property
    def held_version(self) -> int | None:
        return None if self.held is None else self.held[1]

    @property
    def held_path(self) -> str | None:
        """The version directory whose exact weights are served (names the run, not just the version)."""
        return None if self.held is None else str(self.held[0] / f"v{self.held[1]:06d}")

    def adopt_sent(self, ref: VersionRef, named: list[tuple[str, torch.Tensor]], checksums: dict[str, str],
                   algorithm: str) -> str:
        """After a trainer-sent version was checked against the trainer's `checksums` and swapped in:
        `keep_sent`, then `adopt(ref)` at once. Returns "" when adopted, else why not."""
        self.keep_sent(named, checksums, algorithm)
        return self.adopt(ref)

    def keep_sent(self, named: list[tuple[str, torch.Tensor]], checksums: dict[str, str],
                  algorithm: str) -> None:
        """After a trainer-sent version was checked against the trainer's `checksums` and swapped in: a
        copy of its served bytes (`named`, which the next transfer overwrites) and the checksums, for
        `adopt` once the store has the version. The engine holds no store version meanwhile."""
        self.forget()
        copies = {name: t.detach().contiguous().clone() for name, t in named}
        self.sent = SentCopy(copies, dict(checksums), algorithm)

    def adopt(self, ref: VersionRef) -> str:
        """When the store's index of `ref` lists exactly the kept sent tensors with the same checksums
        (same algorithm, dtype, shape), the bytes served are that store version's, and it becomes the
        held version (the copy is kept for the next delta). Returns "" when adopted, else why not (the
        engine then holds no store version)."""
        if self.sent is None:
            return "no trainer-sent version is kept to adopt (another update came after it)"
        sent, checksums, algorithm = self.sent.tensors, self.sent.checksums, self.sent.algorithm
        self.forget()
        try:
            index = ref.store.index(ref.version)
        except WeightStoreError as exc:
            return str(exc)
        if index.kind == "adapter":
            return f"version {ref.version} is an adapter version"
        if index.checksum != algorithm:
            return (f"the store hashed version {ref.version} with {index.checksum}, "
                    f"the trainer with {algorithm}")
        entries = {e.name: e for e in index.tensors}
        if set(entries) - set(sent) or set(sent) - set(entries) - set(index.aliases):
            return f"the store's version {ref.version} and the sent version name different tensors"
        arrays: dict[str, np.ndarray] = {}
        for name, entry in entries.items():
            t = sent[name]
            if checksums.get(name) != entry.checksum or list(t.shape) != list(entry.shape) \
                    or STORAGE_DTYPES[entry.dtype].itemsize != t.element_size():
                return f"{name} is not the store's version {ref.version} (checksum, shape or dtype)"
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            arrays[name] = raw.view(STORAGE_DTYPES[entry.dtype]).reshape(t.shape).copy()
        self.served = ServedTensors(arrays, {n: e.dtype for n, e in entries.items()}, index.aliases)
        self.held = ref.key
        return ""

    # --- locating a version ---------------------------------------------------------------------
    def locate(self, model_path: str) -> VersionRef:
        parsed = urlparse(model_path)
        if parsed.scheme not in ("", "file"):
            raise StoreLoadError(f"model_path {model_path!r}: only local paths and "
                                 "file:// URIs are supported")
        path = Path(unquote(parsed.path) if parsed.scheme else model_path)
        if not path.is_absolute():
            raise StoreLoadError(f"model_path {model_path!r} must be an absolute version "
                                 "directory of the store")
        root = self.root or path.parent.parent
        try:
            resolved = confine(path, root)
        except PathOutsideStore as exc:
            raise StoreLoadError(str(exc)) from None
        if not (resolved / INDEX_FILE).is_file():
            raise StoreLoadError(f"version not found: {model_path} is not a version "
                                 "directory of a weight store")
        run_dir = resolved.parent
        store = self._stores.get(run_dir)
        if store is None:
            try:
                store = DirectoryWeightStore(run_dir.parent, run_dir.name, self.store_config)
            except PathOutsideStore as exc:
                raise StoreLoadError(f"not a weight store run directory: {exc}") from None
            self._stores[run_dir] = store
        try:
            return VersionRef(store, store.version_from_uri(str(resolved)))
        except WeightStoreError as exc:
            raise StoreLoadError(str(exc)) from None

    # --- delta ----------------------------------------------------------------------------------
    def prepare_delta(self, ref: VersionRef) -> PreparedDelta:
        """Fetch, decode, preverify and stage while the engine keeps serving; raises StoreLoadError."""
        try:
            index = ref.store.index(ref.version)
        except WeightStoreError as exc:
            raise StoreLoadError(str(exc)) from None
        if index.kind != "delta":
            raise StoreLoadError(
                f"version {ref.version} is a {index.kind} checkpoint, not a delta; use kind full"
            )
        if self.held != (ref.store.run_dir, index.base_version) or self.served is None:
            holds = (
                "no weight-store version"
                if self.held is None
                else f"version {self.held[1]}"
                + ("" if self.held[0] == ref.store.run_dir else f" of {self.held[0]}")
            )
            raise StoreLoadError(
                f"base version mismatch: delta {ref.version} applies to version {index.base_version} "
                f"of {ref.store.run_dir}, the engine holds {holds}"
            )
        started = time.perf_counter()
        try:
            decoded = ref.store.fetch_delta(ref.version)
        except (CorruptVersion, VersionNotFound) as exc:
            raise StoreLoadError(f"corrupt or missing delta: {exc}") from None
        fetched = time.perf_counter()
        try:
            preverify_delta(self.served, decoded, workers=self.store_config.workers)
        except WeightStoreError as exc:
            raise StoreLoadError(f"delta refused by preverify: {exc}") from None
        verified = time.perf_counter()
        scatters, replacements = self._stage(decoded)
        return PreparedDelta(
            ref, decoded, fetched - started, verified - fetched, time.perf_counter() - verified,
            (index.changed_values or 0) / (index.total_values or 1), scatters, replacements,
        )  # fmt: skip

    def _stage(self, decoded: DecodedDelta) -> tuple[list, list]:
        """The parameters' side of the swap (in their dtype), computed before the pause from
        preverify's staged overwrites."""
        assert self.served is not None
        shared = self._shared_storages()
        scatters, replacements = [], []
        for name, tensor in decoded.changed.items():
            param = self.runner.parameter(name)
            dtype = self.served.dtypes[name]
            assert tensor.encoding == "overwrite" and tensor.values is not None, "preverify stages overwrites"
            if tensor.positions is not None:
                values = _as_torch(tensor.values, dtype).to(param.dtype, copy=True)
                positions = torch.from_numpy(tensor.positions.astype(np.int64, copy=False))
                scatters.append((param, positions, values))
                continue
            # A copy even when the dtypes match: the parameter adopts it as its storage, and the decoded
            # buffer is not ours to keep.
            new = _as_torch(tensor.values, dtype).to(param.dtype, copy=True).view(param.shape)
            if param.data_ptr() in shared:  # storage shared with another Parameter object: write into it
                scatters.append((param, torch.arange(param.numel()), new.reshape(-1)))
            else:
                replacements.append((param, new))
        return scatters, replacements

    def _shared_storages(self) -> set[int]:
        owners: dict[int, set[int]] = {}
        for _, param in self.runner.model.named_parameters(remove_duplicate=False):
            owners.setdefault(param.data_ptr(), set()).add(id(param))
        return {ptr for ptr, ids in owners.items() if len(ids) > 1}

    def swap_delta(self, prepared: PreparedDelta) -> None:
        """The pause: scatters and buffer swaps into the model, nothing else. The served bytes are
        brought up to date by `finish_delta`, after the engine has resumed."""
        assert self.held == (prepared.ref.store.run_dir, prepared.decoded.base_version)
        self.held = None  # the parameters are the new version, the served bytes not yet
        self.runner.weights_changed()
        with torch.no_grad():
            for param, index, values in prepared.scatters:
                param.data.view(-1).index_copy_(0, index, values)
            for param, new in prepared.replacements:
                param.data = new

    def finish_delta(self, prepared: PreparedDelta) -> ApplyResult | None:
        """After the pause: the served bytes become the new version too (`apply_delta`, in place; the
        preverified buffers need no hashing). On failure the engine serves the new version but holds
        no store version, so the next store update is a full one."""
        assert self.served is not None
        try:
            result = apply_delta(self.served, prepared.decoded, current_version=prepared.decoded.base_version,
                                 workers=self.store_config.workers)  # fmt: skip
        except WeightStoreError:
            log.exception("updating the served bytes after swapping in version %d failed",
                          prepared.ref.version)
            self.forget()
            return None
        self.held = prepared.ref.key
        return result

    # --- full -----------------------------------------------------------------------------------
    def prepare_full(self, ref: VersionRef) -> PreparedFull:
        """Rebuilds any version exactly (full checkpoint + deltas, checksums verified);
        raises StoreLoadError."""
        started = time.perf_counter()
        try:
            chain = ref.store.chain(ref.version)
            tensors = ref.store.load_version(ref.version)
        except WeightStoreError as exc:
            raise StoreLoadError(f"version {ref.version} cannot be rebuilt exactly "
                                 f"from the store: {exc}") from None
        self._check_covers_model(tensors)
        read = sum(ref.store.index(v).total_bytes for v in chain)
        return PreparedFull(ref, tensors, time.perf_counter() - started, read)

    def _check_covers_model(self, tensors: ServedTensors) -> None:
        from rlfleet.engine.model_runner import WeightLoadError

        try:
            self.runner.check_weights((name, arr.shape) for name, arr in tensors.items())
        except WeightLoadError as exc:
            raise StoreLoadError(str(exc)) from None
        covered = {self.runner.parameter(name).data_ptr() for name in tensors}
        missing = [
            name for name, p in self.runner.model.named_parameters() if p.data_ptr() not in covered
        ]
        if missing:
            raise StoreLoadError("the version lacks parameters of the served model: "
                                 f"{', '.join(missing[:8])}")

    def install_full(self, prepared: PreparedFull) -> None:
        """The pause of a full load: copies every tensor into the model (cast to its dtype)."""
        tensors = prepared.tensors
        self.forget()  # a failure half way must not leave a held version behind
        self.runner.weights_changed()
        with torch.no_grad():
            for name, arr in tensors.items():
                served = _as_torch(arr, tensors.dtypes[name]).view(-1)
                self.runner.parameter(name).detach().view(-1).copy_(served)
        self.served, self.held = tensors, prepared.ref.key


def _as_torch(values: np.ndarray, dtype: str) -> torch.Tensor:
    """The served bytes as a torch tensor of their dtype (no copy); torch's copy_ then converts."""
    if dtype == "BF16":
        return torch.from_numpy(values.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(values)
