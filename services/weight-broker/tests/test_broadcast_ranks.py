"""SGLang's rank arithmetic for broadcast groups: each TP rank of an engine is rank_offset + tp_rank,
so engine i starts after the sender and every TP rank before it, and the world counts them all."""

from __future__ import annotations

import pytest
from aiohttp import web

from rlfleet.broker.pools import EngineRef, Pools
from rlfleet.broker.transports import BroadcastPlan, Distributed, VersionInfo, rank_layout
from rlfleet.common.engine_client import EngineTimeouts


def test_ranks_follow_sglangs_rank_offset_plus_tp_rank():
    assert rank_layout([1]) == ([1], 2)
    assert rank_layout([2, 1, 4]) == ([1, 3, 4], 8)
    with pytest.raises(ValueError):
        rank_layout([1, 0])


@pytest.fixture
async def recording_engines():
    """Two SGLang-shaped engines that record init_weights_update_group and refuse to join."""
    seen: list[dict] = []

    async def init(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response({"success": False, "message": "recorded"}, status=400)

    async def destroy(request: web.Request) -> web.Response:
        return web.json_response({"success": True, "message": ""})

    runners, urls = [], []
    for _ in range(2):
        app = web.Application()
        app.router.add_post("/init_weights_update_group", init)
        app.router.add_post("/destroy_weights_update_group", destroy)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
    yield urls, seen
    for runner in runners:
        await runner.cleanup()


async def test_a_tp2_engine_takes_two_ranks_and_the_next_engine_starts_after_them(recording_engines):
    urls, seen = recording_engines
    pools = Pools([], None, EngineTimeouts(weights_s=10))
    try:
        plan = BroadcastPlan("127.0.0.1", 1, "g", "nccl", ["w"], ["bfloat16"], [[2, 2]], tp_sizes=(2, 1))
        engines = [EngineRef("tp2", urls[0], "fleet"), EngineRef("tp1", urls[1], "fleet")]
        outcomes = await Distributed(pools, plan).update(engines,
                                                         VersionInfo(3, "", "full", None, 0, 0, None))
    finally:
        await pools.close()
    assert all(not o.ok and o.refused for o in outcomes)
    by_offset = sorted((body["rank_offset"], body["world_size"], body["backend"]) for body in seen)
    assert by_offset == [(1, 4, "nccl"), (3, 4, "nccl")]
