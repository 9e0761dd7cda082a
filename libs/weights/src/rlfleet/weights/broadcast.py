"""torch.distributed weight-update groups, wire-compatible with SGLang's `update_weights_from_distributed`.

The protocol (SGLang `init_weights_update_group` / `update_weights_from_distributed`):
  * The sender (trainer rank 0) and every engine join one extra process group by TCP rendezvous at
    `master_address:master_port`: the sender is rank 0, each TP rank of an engine is `rank_offset`
    + its TP rank (the CPU engine has TP size 1), `world_size` counts all of them (1 + the sum of
    the engines' TP sizes). Like SGLang's `init_custom_process_group`, the
    group is a fresh one with its store prefixed by `group_name`, not the default group, so it
    coexists with whatever groups the trainer already runs.
  * For an update the sender POSTs `names`, `dtypes`, `shapes` to each engine and broadcasts each
    tensor from rank 0, in the order of `names`; the engines receive them all, then load them.

The helpers serve both sides: the engine uses `join_group` + `receive`, a sender (the trainer's
`rlfleet.broker.distributed_sender`, the tests) uses `join_group` + `send`. Tensors are sent from
where they live: over gloo from host memory, over NCCL from a GPU (no host copy); `receive` allocates
on `device`. Shared by the CPU engine and the broker's sender, so it lives in this library.
"""

from __future__ import annotations

import inspect
from datetime import timedelta

import torch
import torch.distributed as dist


def join_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = 300.0,
):
    """Creates (rank 0 hosts the TCP store) or joins the group; blocks until all ranks are in."""
    from torch.distributed.distributed_c10d import (
        Backend,
        GroupName,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    # The keyword for backend options was renamed across torch releases.
    params = inspect.signature(_new_process_group_helper).parameters
    options = {"backend_options" if "backend_options" in params else "pg_options": None}
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=GroupName(group_name),
        timeout=timeout, **options
    )
    # Group rank == "global" rank for this group, so `broadcast(src=0, group=...)` resolves.
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def receive(
    group, names: list[str], dtypes: list[str], shapes: list[list[int]], device: str | torch.device = "cpu"
) -> list[tuple[str, torch.Tensor]]:
    """Receives one broadcast per name from rank 0, in order (into tensors on `device`)."""
    tensors = [
        torch.empty(shape, dtype=parse_dtype(dtype), device=device)
        for dtype, shape in zip(dtypes, shapes, strict=True)
    ]
    handles = [dist.broadcast(tensor, src=0, group=group, async_op=True) for tensor in tensors]
    for handle in handles:
        handle.wait()
    return list(zip(names, tensors, strict=True))


def send(group, tensors: list[torch.Tensor]) -> None:
    """Rank 0's side of `receive`: broadcasts the tensors in order."""
    handles = [dist.broadcast(t.detach().contiguous(), src=0, group=group, async_op=True) for t in tensors]
    for handle in handles:
        handle.wait()


def update_request(named: list[tuple[str, torch.Tensor]], **extra) -> dict:
    """The JSON body of `/update_weights_from_distributed` announcing `named`."""
    return {
        "names": [name for name, _ in named],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
        "shapes": [list(t.shape) for _, t in named],
        **extra,
    }


def leave_group(group) -> None:
    dist.destroy_process_group(group)
