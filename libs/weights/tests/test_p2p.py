"""Peer-to-peer transfer between two real processes over Mooncake's TransferEngine (tcp on loopback)."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from rlfleet.weights.p2p import (
    ChecksumMismatch,
    Endpoint,
    LayoutMismatch,
    P2PError,
    P2PSender,
    StagingBuffers,
    TransferAgent,
)

SHAPES = {"embed.weight": ((96, 32), torch.bfloat16), "layer.q.weight": ((32, 32), torch.bfloat16),
          "layer.q.bias": ((32,), torch.float32), "norm.weight": ((33,), torch.bfloat16)}


def _template() -> dict[str, torch.Tensor]:
    return {n: torch.zeros(shape, dtype=dtype) for n, (shape, dtype) in SHAPES.items()}


def _version(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g).to(dtype) for n, (shape, dtype) in SHAPES.items()}


def _receiver(conn: Any) -> None:
    """An engine's side: staging published, then verify-and-report on command."""
    torch.set_num_threads(1)
    staging = StagingBuffers(TransferAgent(), _template())
    conn.send(staging.endpoint().to_json())
    while True:
        command, *args = conn.recv()
        if command == "close":
            staging.close()
            return
        try:
            staging.verify(*args)
            conn.send(("ok", {n: t.float().tolist() for n, t in staging.tensors.items()}))
        except ChecksumMismatch as e:
            conn.send(("checksum", sorted(e.names)))


@pytest.fixture
def receiver() -> Iterator[tuple[Any, Endpoint, Any]]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_receiver, args=(child,), daemon=True)
    process.start()
    try:
        assert parent.poll(60), "the receiver did not publish its endpoint"
        yield parent, Endpoint.from_json(parent.recv()), process
    finally:
        if process.is_alive():
            parent.send(("close",))
            process.join(10)
        if process.is_alive():
            process.kill()


@pytest.fixture(scope="module")
def agent() -> TransferAgent:
    return TransferAgent()


def test_a_version_written_into_staging_arrives_bit_identical_across_buckets(receiver, agent):
    conn, endpoint, _ = receiver
    sender = P2PSender(agent, bucket_bytes=1024)
    for seed in (1, 2):  # the second version reuses the sender's registered buffer
        state = _version(seed)
        report = sender.send(state, endpoint)
        assert report.bytes_sent == sum(t.numel() * t.element_size() for t in state.values())
        conn.send(("verify", report.checksums, report.algorithm))
        status, received = conn.recv()
        assert status == "ok"
        assert {n: torch.tensor(v).to(state[n].dtype).view(state[n].shape).equal(state[n])
                for n, v in received.items()} == dict.fromkeys(state, True)


def test_a_transfer_that_stops_part_way_is_refused_by_checksum(receiver, agent):
    conn, endpoint, _ = receiver
    sender = P2PSender(agent, bucket_bytes=1024, algorithm="crc32")
    sender.send(_version(1), endpoint)
    report = sender.send(_version(2), endpoint, only={"embed.weight", "layer.q.bias"})
    conn.send(("verify", report.checksums, report.algorithm))
    assert conn.recv() == ("checksum", ["layer.q.weight", "norm.weight"])


def test_a_sender_whose_tensors_do_not_fit_the_layout_writes_nothing(receiver, agent):
    _, endpoint, _ = receiver
    state = _version(1)
    state["layer.q.weight"] = torch.zeros(16, 32, dtype=torch.bfloat16)
    with pytest.raises(LayoutMismatch, match="layer.q.weight"):
        P2PSender(agent).send(state, endpoint)
    del state["layer.q.weight"]
    with pytest.raises(LayoutMismatch, match="expects 1 more"):
        P2PSender(agent).send(state, endpoint)


def test_a_receiver_that_is_gone_fails_the_write_instead_of_hanging(receiver, agent):
    conn, endpoint, process = receiver
    conn.send(("close",))
    process.join(10)
    with pytest.raises(P2PError, match="returned"):
        P2PSender(agent).send(_version(1), endpoint)


def test_the_endpoint_reads_and_writes_sglangs_remote_instance_shape():
    body = {"rank": 1, "remote_instance_transfer_engine_info": ["127.0.0.1:1234", {"w": [4096, 8, 2]}]}
    endpoint = Endpoint.from_json(body)
    assert endpoint.session_id == "127.0.0.1:1234" and endpoint.tensors["w"].nbytes == 16
    assert endpoint.to_json() == body
    with pytest.raises(P2PError, match="not a transfer-engine endpoint"):
        Endpoint.from_json({"remote_instance_transfer_engine_info": ["x"]})


def _rank(rank: int, port: int, endpoint_json: dict, version: dict[str, torch.Tensor], conn: Any) -> None:
    """One rank of a two-rank FSDP-style trainer: its dim-0 shards as DTensors, sent by itself."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from rlfleet.weights.p2p import local_shards

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        state = {n: distribute_tensor(t, mesh,
                                      [Replicate() if t.dim() == 0 or n == "layer.q.bias" else Shard(0)])
                 for n, t in version.items()}  # fmt: skip
        endpoint = Endpoint.from_json(endpoint_json)
        shards = local_shards(state, endpoint.tensors, dtype=None, rank=rank)
        sender = P2PSender(TransferAgent(), bucket_bytes=1 << 10)
        report = sender.send_shards(shards, endpoint)
        sender.close()
        dist.barrier()
        conn.send((rank, report.bytes_sent, {n: sh.byte_offset for n, sh in shards.items()}))
    finally:
        dist.destroy_process_group()


def test_every_rank_writes_its_own_shard_at_its_offset_and_the_receiver_gets_the_whole_version(receiver):
    """Two trainer ranks, each holding dim-0 shards (an odd row count too: uneven pieces) and one
    replicated tensor, write only their own bytes; the receiver verifies the assembled tensors
    against the whole tensors' checksums."""
    from rlfleet.common.processes import free_port
    from rlfleet.weights.codec import checksum
    from rlfleet.weights.torch_io import byte_view

    conn, endpoint, _ = receiver
    version = _version(7)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    port = free_port()
    ranks = [ctx.Process(target=_rank, args=(r, port, endpoint.to_json(), version, child), daemon=True)
             for r in (0, 1)]  # fmt: skip
    for p in ranks:
        p.start()
    try:
        reports = {}
        for _ in ranks:
            assert parent.poll(120), "a rank did not report"
            rank, sent, offsets = parent.recv()
            reports[rank] = (sent, offsets)
    finally:
        for p in ranks:
            p.join(30)
    whole = sum(t.numel() * t.element_size() for t in version.values())
    assert reports[0][0] + reports[1][0] == whole  # every byte once, no rank sent the rest's
    assert reports[1][1]["embed.weight"] == 48 * 32 * 2 and "layer.q.bias" not in reports[1][1]
    assert reports[1][1]["norm.weight"] == 17 * 2  # 33 rows: 17 on rank 0, 16 on rank 1
    sums = {n: checksum(byte_view(t), "sha256") for n, t in version.items()}
    conn.send(("verify", sums, "sha256"))
    status, got = conn.recv()
    assert status == "ok", got
    for name, t in version.items():
        assert torch.equal(torch.tensor(got[name], dtype=torch.float32), t.float()), name
