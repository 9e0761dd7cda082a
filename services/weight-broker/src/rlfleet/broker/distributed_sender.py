"""The sender side of the distributed transport, for the trainer (rank 0) to call.

    from rlfleet.broker.distributed_sender import send_version
    result = send_version("broker:7005", policy_version, model.state_dict(), master_address="10.0.0.7")

1. `StartDistributedSync` asks the broker which engines take this version (its sync policy and pools
   decide; it may say none: then nothing is sent). The broker has those engines join a process
   group at `master_address:master_port` and receive `names`/`dtypes`/`shapes` (SGLang's
   `init_weights_update_group` + `update_weights_from_distributed`), with SGLang's rank arithmetic:
   engine i at `rank_offset` 1 + the TP sizes before it, one rank per TP rank, world size 1 + the
   sum of TP sizes.
2. This process joins the group as rank 0 and broadcasts each tensor in order, cast to the served
   dtype (bf16 by default: the bytes the weight store serves, so both transports give engines
   identical weights), then leaves the group. Tensors stay where they are: CUDA tensors go over
   NCCL (the backend defaults to nccl when they are on a GPU, gloo otherwise), never through a
   host copy.

The version should also be in the weight store: engines that miss a broadcast (down, promoted
later, new, rolled back) catch up from there. The wire protocol itself is `rlfleet.weights.broadcast`
(join_group/send/receive, SGLang-compatible; the CPU engine receives with it); torch and that module
are imported only when `send_version` runs, so importing this module stays light.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rlfleet.api.broker.v1 import broker_pb2, broker_pb2_grpc
from rlfleet.api.common.v1 import common_pb2
from rlfleet.common.grpc_server import blocking_channel


@dataclass(frozen=True)
class SendResult:
    version: int
    group_name: str
    engine_ids: list[str]  # engine_ids[i] held ranks rank_offsets[i] .. + tp_sizes[i] - 1
    rank_offsets: list[int]
    sent_bytes: int
    seconds: float
    state: int  # the version's VersionState at the broker


def _free_port(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def _unique(named: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Tied tensors (lm_head sharing embed_tokens) are sent once: the engine's copy is tied too."""
    seen, out = set(), []
    for name, tensor in named:
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            out.append((name, tensor))
    return out


def send_version(
    broker_address: str,
    version: common_pb2.PolicyVersion,
    tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
    *,
    master_address: str,
    master_port: int = 0,
    backend: str | None = None,
    dtype: str | None = "bfloat16",
    timeout_s: float = 120.0,
) -> SendResult:
    """Broadcasts `tensors` (a torch state dict) as `version` to the engines the broker names.

    Blocks until every engine has received every tensor. `dtype`: cast floating tensors to it
    before sending (None: send as they are). `master_port` 0 picks a free port. `backend`: None
    picks nccl for CUDA tensors, gloo for CPU ones.
    """
    import torch

    from rlfleet.weights import broadcast as distributed

    started = time.monotonic()
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    cast = getattr(torch, dtype) if dtype else None
    named = [
        (name,
         (t.detach().to(cast) if cast is not None and t.is_floating_point() else t.detach()).contiguous())
        for name, t in _unique(items)
    ]
    on_gpu = any(t.is_cuda for _, t in named)
    if backend is None:
        backend = "nccl" if on_gpu else "gloo"
    if on_gpu and backend != "nccl":
        raise ValueError(f"CUDA tensors go over nccl, not {backend}")
    port = master_port or _free_port(master_address)
    request = broker_pb2.StartDistributedSyncRequest(
        version=version, master_address=master_address, master_port=port, backend=backend,
        tensors=[broker_pb2.TensorSpec(name=n, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape))
                 for n, t in named],
    )  # fmt: skip
    with blocking_channel(broker_address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        plan = broker_pb2_grpc.BrokerServiceStub(channel).StartDistributedSync(request, timeout=60)
    if plan.world_size <= 1:
        return SendResult(version.version, plan.group_name, [], [], 0, time.monotonic() - started, plan.state)
    group = distributed.join_group(master_address, port, 0, plan.world_size, plan.group_name,
                                   backend, timeout_s)
    try:
        distributed.send(group, [t for _, t in named])
    finally:
        distributed.leave_group(group)
    sent = sum(t.numel() * t.element_size() for _, t in named)
    return SendResult(version.version, plan.group_name, list(plan.engine_ids), list(plan.rank_offsets), sent,
                      time.monotonic() - started, plan.state)  # fmt: skip
