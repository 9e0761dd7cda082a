"""Peer-to-peer weight transfer with Mooncake's TransferEngine.

The receiver (an engine) registers one staging buffer laid out like its model and publishes where
each tensor lives; the sender (the trainer) writes the new version's bytes straight into it, in
buckets, and hands over per-tensor checksums; the receiver verifies them before it swaps anything,
so a partial or corrupted transfer is refused and the engine keeps serving what it had.

The endpoint is described the way SGLang describes its own registered weights for remote-instance
loading (``GET /remote_instance_transfer_engine_info?rank=N`` ->
``{"rank": N, "remote_instance_transfer_engine_info": [session_id, {name: [ptr, numel,
element_size]}]}``), so one reader serves both. Staging, not the live weights, is what is
registered here: the engine keeps generating while a transfer lands, and only the copy from staging
into the model sits inside the weight-update pause.

``protocol`` is ``tcp`` on this machine and ``rdma`` on a fleet; no metadata server is needed
(``P2PHANDSHAKE``: the session id is ``host:rpc_port``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from rlfleet.weights.codec import CHECKSUM_ALGORITHMS, checksum
from rlfleet.weights.torch_io import byte_view

DEFAULT_BUCKET_BYTES = 64 << 20
PROTOCOLS = ("tcp", "rdma")


class P2PError(Exception):
    """A peer-to-peer transfer could not be set up or did not complete (callers fall back to the store)."""


class LayoutMismatch(P2PError):
    """The sender's tensors do not fit the receiver's published layout (names, sizes)."""


class ChecksumMismatch(P2PError):
    """Staging holds bytes other than the sender's: a partial, interrupted or corrupted transfer."""

    def __init__(self, names: list[str]) -> None:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        super().__init__(f"{len(names)} tensor(s) arrived with the wrong checksum: {shown}")
        self.names = names


@dataclass(frozen=True)
class RemoteTensor:
    ptr: int
    numel: int
    element_size: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


@dataclass(frozen=True)
class Endpoint:
    """Where a receiver's staging tensors live, in SGLang's remote-instance shape."""

    session_id: str
    tensors: dict[str, RemoteTensor]
    rank: int = 0

    def to_json(self) -> dict[str, Any]:
        layout = {n: [t.ptr, t.numel, t.element_size] for n, t in self.tensors.items()}
        return {"rank": self.rank, "remote_instance_transfer_engine_info": [self.session_id, layout]}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Endpoint:
        try:
            session_id, layout = body["remote_instance_transfer_engine_info"]
            tensors = {str(n): RemoteTensor(int(p), int(k), int(e)) for n, (p, k, e) in layout.items()}
            return cls(str(session_id), tensors, int(body.get("rank", 0)))
        except (KeyError, TypeError, ValueError) as e:
            raise P2PError(f"not a transfer-engine endpoint description: {e!r}") from e


class TransferAgent:
    """One Mooncake TransferEngine for this process (engines are expensive: keep one per process)."""

    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "tcp", device_name: str = "") -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"unknown transfer protocol {protocol!r}; use one of {PROTOCOLS}")
        # Imported here, not at module level: the wheel is a native library that needs libibverbs, and
        # the store, the delta path and the broadcast path must keep working on a host without it.
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise P2PError(
                f"Mooncake's TransferEngine is not importable ({e}); install "
                "mooncake-transfer-engine-non-cuda and Debian's libibverbs1 (scripts/install.sh does)"
            ) from e
        self._engine = TransferEngine()
        rc = self._engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise P2PError(f"TransferEngine.initialize({hostname!r}, protocol={protocol!r}) returned {rc}")
        self.session_id = f"{hostname}:{self._engine.get_rpc_port()}"
        self._registered: dict[int, int] = {}

    def register(self, buffer: torch.Tensor) -> None:
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError("only contiguous host buffers can be registered with the non-CUDA engine")
        ptr, length = buffer.data_ptr(), buffer.numel() * buffer.element_size()
        if self._registered.get(ptr) == length:
            return
        rc = self._engine.register_memory(ptr, length)
        if rc != 0:
            raise P2PError(f"register_memory of {length} bytes returned {rc}")
        self._registered[ptr] = length

    def unregister(self, buffer: torch.Tensor) -> None:
        ptr = buffer.data_ptr()
        if self._registered.pop(ptr, None) is not None:
            self._engine.unregister_memory(ptr)

    def write(self, target: str, sources: list[int], destinations: list[int], lengths: list[int]) -> None:
        rc = self._engine.batch_transfer_sync_write(target, sources, destinations, lengths)
        if rc != 0:
            raise P2PError(f"write of {sum(lengths)} bytes in {len(lengths)} "
                           f"piece(s) to {target} returned {rc}")


def _flat_layout(template: Mapping[str, torch.Tensor]) -> tuple[dict[str, tuple[int, int]], int]:
    """name -> (byte offset, byte length) in one flat buffer, each tensor 64-byte aligned."""
    offsets: dict[str, tuple[int, int]] = {}
    cursor = 0
    for name, t in template.items():
        nbytes = t.numel() * t.element_size()
        offsets[name] = (cursor, nbytes)
        cursor += (nbytes + 63) // 64 * 64
    return offsets, cursor


def _views(flat: torch.Tensor, template: Mapping[str, torch.Tensor],
           offsets: Mapping[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    return {name: flat[offsets[name][0]:offsets[name][0] + offsets[name][1]].view(t.dtype).view(t.shape)
            for name, t in template.items()}


class StagingBuffers:
    """The receiving side: one registered buffer shaped like ``template`` (name -> tensor)."""

    def __init__(self, agent: TransferAgent, template: Mapping[str, torch.Tensor], rank: int = 0) -> None:
        self._agent = agent
        self._offsets, size = _flat_layout(template)
        self._flat = torch.zeros(max(size, 1), dtype=torch.uint8)
        agent.register(self._flat)
        self.tensors = _views(self._flat, template, self._offsets)
        self.rank = rank

    def endpoint(self) -> Endpoint:
        base = self._flat.data_ptr()
        return Endpoint(self._agent.session_id,
                        {n: RemoteTensor(base + off, t.numel(), t.element_size())
                         for (n, t), (off, _) in zip(self.tensors.items(), self._offsets.values(),
                                                     strict=True)},
                        self.rank)

    def verify(self, checksums: Mapping[str, str], algorithm: str) -> None:
        """Raises unless every staged tensor is exactly what the sender hashed."""
        if algorithm not in CHECKSUM_ALGORITHMS:
            raise P2PError(f"unknown checksum algorithm {algorithm!r}; use one of {CHECKSUM_ALGORITHMS}")
        if set(checksums) != set(self.tensors):
            missing = sorted(set(self.tensors) - set(checksums))
            extra = sorted(set(checksums) - set(self.tensors))
            raise LayoutMismatch("checksums for the wrong tensors: "
                                 f"missing {missing[:5]}, unknown {extra[:5]}")
        bad = [n for n, t in self.tensors.items() if checksum(byte_view(t), algorithm) != checksums[n]]
        if bad:
            raise ChecksumMismatch(bad)

    def close(self) -> None:
        self._agent.unregister(self._flat)


@dataclass
class SendReport:
    bytes_sent: int
    seconds: float
    checksums: dict[str, str] = field(repr=False)
    algorithm: str = "sha256"


class P2PSender:
    """The sending side: packs a state dict into a registered host buffer (reused while the layout
    stays the same) and writes it into a receiver's staging, ``bucket_bytes`` per batch."""

    def __init__(self, agent: TransferAgent, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 algorithm: str = "sha256") -> None:
        if bucket_bytes <= 0:
            raise ValueError("bucket_bytes must be positive")
        if algorithm not in CHECKSUM_ALGORITHMS:
            raise ValueError(f"unknown checksum algorithm {algorithm!r}; use one of {CHECKSUM_ALGORITHMS}")
        self._agent = agent
        self.bucket_bytes = bucket_bytes
        self.algorithm = algorithm
        self._flat: torch.Tensor | None = None
        self._layout: tuple[tuple[str, tuple[int, ...], torch.dtype], ...] = ()
        self._views: dict[str, torch.Tensor] = {}
        self._offsets: dict[str, tuple[int, int]] = {}

    def close(self) -> None:
        """Unregisters the send buffer. Also on garbage collection: a freed buffer left registered
        makes the agent refuse any later buffer the allocator places over it (register_memory -7)."""
        if self._flat is not None:
            self._agent.unregister(self._flat)
            self._flat = None
            self._layout = ()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the agent may be gone already
            pass

    def _pack(self, state: Mapping[str, torch.Tensor]) -> None:
        layout = tuple((n, tuple(t.shape), t.dtype) for n, t in state.items())
        if layout != self._layout:
            if self._flat is not None:
                self._agent.unregister(self._flat)
            self._offsets, size = _flat_layout(state)
            self._flat = torch.empty(max(size, 1), dtype=torch.uint8)
            self._agent.register(self._flat)
            self._views = _views(self._flat, state, self._offsets)
            self._layout = layout
        for name, t in state.items():
            # Device-to-host here when the trainer is on a GPU: the non-CUDA engine reads host memory.
            self._views[name].copy_(t.detach())

    def send(self, state: Mapping[str, torch.Tensor], endpoint: Endpoint,
             only: set[str] | None = None) -> SendReport:
        """Writes ``state`` into the endpoint's staging. ``only`` limits which tensors travel (the
        rest keep what staging had, and the checksums tell the receiver): tests use it to stand for a
        transfer that died part-way."""
        wrong = [n for n, t in state.items()
                 if n not in endpoint.tensors or endpoint.tensors[n].nbytes != t.numel() * t.element_size()]
        if wrong or set(endpoint.tensors) != set(state):
            absent = sorted(set(endpoint.tensors) - set(state))
            raise LayoutMismatch(f"sender and receiver disagree on {len(wrong)} tensor(s) {wrong[:5]}"
                                 f" and the receiver expects {len(absent)} more {absent[:5]}")
        started = time.perf_counter()
        self._pack(state)
        assert self._flat is not None
        base = self._flat.data_ptr()
        sources: list[int] = []
        destinations: list[int] = []
        lengths: list[int] = []
        pending = sent = 0
        for name in state:
            if only is not None and name not in only:
                continue
            offset, nbytes = self._offsets[name]
            sources.append(base + offset)
            destinations.append(endpoint.tensors[name].ptr)
            lengths.append(nbytes)
            pending += nbytes
            if pending >= self.bucket_bytes:
                self._agent.write(endpoint.session_id, sources, destinations, lengths)
                sent += pending
                sources, destinations, lengths, pending = [], [], [], 0
        if lengths:
            self._agent.write(endpoint.session_id, sources, destinations, lengths)
            sent += pending
        checksums = {n: checksum(byte_view(v), self.algorithm) for n, v in self._views.items()}
        return SendReport(sent, time.perf_counter() - started, checksums, self.algorithm)

    def send_shards(self, shards: Mapping[str, Shard], endpoint: Endpoint) -> SendReport:
        """Writes this rank's pieces of the version (`local_shards`) into the endpoint's staging, each
        at its byte offset inside the receiver's tensor: every rank of a sharded trainer sends its own
        bytes, side by side, and no rank gathers the rest. The checksums are the whole tensors' (from
        whoever holds them, e.g. rank 0's gathered state for the store), so the receiver checks the
        assembled transfer; the report's are this rank's pieces only."""
        wrong = [n for n, sh in shards.items() if n not in endpoint.tensors
                 or (sh.byte_offset + sh.tensor.numel() * sh.tensor.element_size()
                     > endpoint.tensors[n].nbytes)]
        if wrong:
            raise LayoutMismatch(f"{len(wrong)} shard(s) do not fit the receiver's tensors: {wrong[:5]}")
        started = time.perf_counter()
        self._pack({n: sh.tensor for n, sh in shards.items()})
        assert self._flat is not None
        base, sent = self._flat.data_ptr(), 0
        sources: list[int] = []
        destinations: list[int] = []
        lengths: list[int] = []
        for name, shard in shards.items():
            offset, nbytes = self._offsets[name]
            if not nbytes:
                continue
            sources.append(base + offset)
            destinations.append(endpoint.tensors[name].ptr + shard.byte_offset)
            lengths.append(nbytes)
            if sum(lengths) >= self.bucket_bytes:
                self._agent.write(endpoint.session_id, sources, destinations, lengths)
                sent += sum(lengths)
                sources, destinations, lengths = [], [], []
        if lengths:
            self._agent.write(endpoint.session_id, sources, destinations, lengths)
            sent += sum(lengths)
        checksums = {n: checksum(byte_view(v), self.algorithm) for n, v in self._views.items()}
        return SendReport(sent, time.perf_counter() - started, checksums, self.algorithm)


@dataclass(frozen=True)
class Shard:
    """One rank's contiguous piece of a tensor: its bytes start `byte_offset` into the whole tensor."""

    tensor: torch.Tensor
    byte_offset: int


def local_shards(state: Mapping[str, Any], names: Any, dtype: torch.dtype | None = torch.bfloat16,
                 rank: int = 0) -> dict[str, Shard]:
    """This rank's pieces of `state` (FSDP2's DTensors, sharded on dim 0 or replicated; plain tensors
    count as replicated) for the tensors in `names`, floating ones cast to `dtype`. A dim-0 shard is a
    contiguous row range, so its bytes sit at one offset in the receiver's tensor; a replicated tensor
    is sent by rank 0 alone."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor import Shard as DimShard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out: dict[str, Shard] = {}
    wanted = set(names)
    for name, value in state.items():
        if name not in wanted:
            continue
        if isinstance(value, DTensor):
            placements = value.placements
            if not all(isinstance(p, Replicate)
                       or (isinstance(p, DimShard) and p.dim == 0) for p in placements):
                raise P2PError(f"{name}: placements {placements} are not dim-0 shards or replicas")
            if all(isinstance(p, Replicate) for p in placements) and rank != 0:
                continue
            _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, placements)
            local, first_row = value.to_local(), int(offset[0]) if len(offset) else 0
        elif rank != 0:
            continue
        else:
            local, first_row = value, 0
        local = local.detach()
        if dtype is not None and local.is_floating_point():
            local = local.to(dtype)
        row_values = 1
        for size in value.shape[1:]:
            row_values *= size
        out[name] = Shard(local.contiguous(), first_row * row_values * local.element_size())
    return out
