"""SGLang's rank arithmetic for real: a broadcast from the sender (rank 0) to an engine with TP 2 and
one with TP 1, each TP rank a process of its own joining the gloo group at `rank_offset + tp_rank`,
as SGLang's workers do. Wrong offsets or world size never rendezvous; right ones deliver every
tensor to every TP rank, checked by checksum against the sender's."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading

import pytest
from aiohttp import web

from rlfleet.broker.pools import EngineRef, Pools
from rlfleet.broker.transports import BroadcastPlan, Distributed, VersionInfo, engine_tp_size
from rlfleet.common.engine_client import EngineTimeouts
from rlfleet.common.processes import free_port

TIMEOUT_S = 60.0


def _tp_rank(conn, address, port, rank, world, group_name) -> None:
    """One TP rank of an engine: joins at its rank, then receives on command."""
    import torch

    from rlfleet.weights import broadcast
    from rlfleet.weights.sent import tensor_checksums

    torch.set_num_threads(1)
    group = broadcast.join_group(address, port, rank, world, group_name, "gloo", TIMEOUT_S)
    conn.send(("joined", rank))
    names, dtypes, shapes = conn.recv()
    named = broadcast.receive(group, names, dtypes, shapes)
    conn.send(("received", tensor_checksums(named)))
    broadcast.leave_group(group)


class TPEngine:
    """An SGLang-shaped engine whose /init_weights_update_group starts one process per TP rank."""

    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size
        self.joined: list[int] = []
        self.received: list[dict[str, str]] = []
        self.conns = []
        self.procs = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/server_info", self.server_info)
        app.router.add_post("/init_weights_update_group", self.init)
        app.router.add_post("/update_weights_from_distributed", self.update)
        app.router.add_post("/destroy_weights_update_group", self.destroy)
        return app

    async def server_info(self, request):
        return web.json_response({"tp_size": self.tp_size, "dp_size": 1})

    async def init(self, request):
        body = await request.json()
        ctx = mp.get_context("spawn")
        for tp_rank in range(self.tp_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_tp_rank, args=(child, body["master_address"], body["master_port"],
                                                       body["rank_offset"] + tp_rank, body["world_size"],
                                                       body["group_name"]), daemon=True)  # fmt: skip
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for conn in self.conns:
            if not await asyncio.to_thread(conn.poll, TIMEOUT_S):
                return web.json_response({"success": False, "message": "a TP rank did not join"}, status=400)
            self.joined.append((await asyncio.to_thread(conn.recv))[1])
        return web.json_response({"success": True, "message": "joined"})

    async def update(self, request):
        body = await request.json()
        for conn in self.conns:
            conn.send((body["names"], body["dtypes"], body["shapes"]))
        for conn in self.conns:
            assert await asyncio.to_thread(conn.poll, TIMEOUT_S)
            self.received.append((await asyncio.to_thread(conn.recv))[1])
        return web.json_response({"success": True, "message": "received", "checksums": self.received[0]})

    async def destroy(self, request):
        for proc in self.procs:
            await asyncio.to_thread(proc.join, TIMEOUT_S)
        return web.json_response({"success": True, "message": ""})


async def _serve(engine: TPEngine):
    runner = web.AppRunner(engine.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


@pytest.mark.slow
async def test_every_tp_rank_of_every_engine_receives_the_broadcast_at_sglangs_rank(monkeypatch):
    import torch

    from rlfleet.weights import broadcast
    from rlfleet.weights.sent import served_named, tensor_checksums

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    torch.manual_seed(0)
    named = served_named({"embed.weight": torch.randn(64, 16), "norm.weight": torch.randn(16),
                          "step": torch.tensor([3], dtype=torch.int64)})  # fmt: skip
    sums = tensor_checksums(named)
    tp2, tp1 = TPEngine(2), TPEngine(1)
    served = [await _serve(tp2), await _serve(tp1)]
    port = free_port()
    pools = Pools([], None, EngineTimeouts(weights_s=TIMEOUT_S))
    engines = [EngineRef("tp2", served[0][1], "fleet"), EngineRef("tp1", served[1][1], "fleet")]
    sizes = [await engine_tp_size(pools, e) for e in engines]
    plan = BroadcastPlan("127.0.0.1", port, "tp-offsets", "gloo", [n for n, _ in named],
                         [str(t.dtype).removeprefix("torch.") for _, t in named],
                         [list(t.shape) for _, t in named],
                         tuple(sizes), checksums=sums)  # fmt: skip
    offsets, world = plan.ranks(len(engines))
    assert (offsets, world) == ([1, 3], 4)

    errors: list[BaseException] = []

    def sender() -> None:
        try:
            group = broadcast.join_group("127.0.0.1", port, 0, world, plan.group_name, "gloo", TIMEOUT_S)
            broadcast.send(group, [t for _, t in named])
            broadcast.leave_group(group)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    thread = threading.Thread(target=sender, daemon=True)
    thread.start()
    try:
        outcomes = await Distributed(pools, plan).update(engines,
                                                         VersionInfo(1, "", "full", None, 0, 0, None))
    finally:
        await asyncio.to_thread(thread.join, TIMEOUT_S)
        await pools.close()
        for runner, _ in served:
            await runner.cleanup()
    assert not errors, errors
    assert all(o.ok for o in outcomes), outcomes
    assert sorted(tp2.joined) == [1, 2] and tp1.joined == [3]
    assert tp2.received == [sums, sums] and tp1.received == [sums]
