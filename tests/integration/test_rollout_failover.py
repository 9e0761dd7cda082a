"""The rollout tier survives its parts dying: a session server killed mid-episode (a new one carries
on from Redis), and an engine killed mid-run (its sessions move to the other engine, reported).

The tests share one stack and run in file order: the restart test leaves both engines up.
"""

from __future__ import annotations

import asyncio
import re
import urllib.request

import grpc
import pytest

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from rlfleet.api.session.v1 import session_pb2 as pb
from rlfleet.api.session.v1 import session_pb2_grpc
from rlfleet.common.grpc_server import channel
from rlfleet.common.processes import eventually
from rlfleet.common.testing import unique_run_id
from rlfleet.engine.testing import http_call, tiny_model
from rlfleet.session.testing import Rollout, read_trajectories

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GENERATED = common_pb2.SPAN_KIND_GENERATED


@pytest.fixture(scope="module")
def rollout(nats_url, redis_url, tmp_path_factory):
    model = tiny_model(tmp_path_factory.getbasetemp() / "models")
    stack = Rollout(tmp_path_factory.mktemp("rollout-failover"), nats_url, redis_url, model,
                    unique_run_id("fo"))
    stack.start(engines=2, gateway={"health_interval_s": 0.5, "metrics.enabled": True})
    yield stack
    stack.stop()


def open_request(seed: int, max_new_tokens: int = 8) -> pb.OpenSessionRequest:
    return pb.OpenSessionRequest(prompt_token_ids=common_pb2.TokenIds(ids=[1, 40 + seed, 41, 42]),
                                 sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens, seed=seed))


def reroutes_counted(rollout) -> float:
    url = f"http://127.0.0.1:{rollout.gateway.info['metrics_port']}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return sum(float(v) for v in re.findall(r"^rlfleet_gateway_reroutes_total\{[^}]*\} (\S+)$", text, re.M))


async def test_a_session_survives_a_session_server_restart_mid_episode(rollout):
    async with channel(rollout.session.address) as ch:
        sessions = session_pb2_grpc.SessionServiceStub(ch)
        opened = await sessions.OpenSession(open_request(1))
        first = await sessions.Generate(pb.GenerateRequest(session_id=opened.session_id))
        observed = await sessions.AppendObservation(pb.AppendObservationRequest(
            session_id=opened.session_id, text="<|im_start|>tool\n42<|im_end|>"))
    rollout.session.kill()  # SIGKILL: nothing flushed, nothing cleaned up
    rollout.start_session_server()
    async with channel(rollout.session.address) as ch:
        sessions = session_pb2_grpc.SessionServiceStub(ch)
        state = await sessions.GetSession(pb.GetSessionRequest(session_id=opened.session_id))
        assert list(state.token_ids) == [*opened.prompt_token_ids, *first.token_ids, *observed.token_ids]
        second = await sessions.Generate(pb.GenerateRequest(session_id=opened.session_id))
        assert second.engine_id == first.engine_id and second.span_index == 3
        closed = await sessions.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id,
                                                                    return_trajectory=True))
    trajectory = closed.trajectory
    assert list(trajectory.token_ids) == [*opened.prompt_token_ids, *first.token_ids, *observed.token_ids,
                                          *second.token_ids]
    assert (trajectory.num_turns, trajectory.num_observations) == (2, 1)
    assert [t.trajectory_id for t in await read_trajectories(rollout.nats_url, rollout.run_id)] == [
        closed.trajectory_id]


async def test_an_open_whose_server_died_inside_its_first_turn_is_answered_by_the_retried_open(rollout):
    """The chaos run's lost samples: the session server SIGKILLed while an OpenSession generated the
    first turn left the session created, with no first turn and a turn lease nobody renews. The
    retried open (the client retries an UNAVAILABLE open) must answer with a first turn, generated
    once, rather than with none, which sent the client into that lease (SESSION_BUSY) and failed it."""
    request = open_request(7, max_new_tokens=900)
    request.session_id, request.first_turn = unique_run_id("open-kill"), True
    request.sampling.ignore_eos = True

    async def generated() -> int:
        total = 0
        for engine in rollout.engines.values():
            status, info = await http_call(engine.url, "/server_info", method="GET")
            assert status == 200, info
            total += info["generated_tokens"]
        return total

    before = await generated()
    async with channel(rollout.session.address) as ch:
        stub = session_pb2_grpc.SessionServiceStub(ch)

        async def open_it():
            return await stub.OpenSession(request)

        opening = asyncio.create_task(open_it())

        async def first_turn_running() -> bool:
            return await generated() > before

        await eventually(first_turn_running, within_s=20)
        rollout.session.kill()
        with pytest.raises(grpc.aio.AioRpcError) as killed:
            await opening
        assert killed.value.code() == grpc.StatusCode.UNAVAILABLE
    rollout.start_session_server()
    async with channel(rollout.session.address) as ch:
        sessions = session_pb2_grpc.SessionServiceStub(ch)
        again = await sessions.OpenSession(request, timeout=60)
        assert again.HasField("first_turn") and len(again.first_turn.token_ids) == 900
        state = await sessions.GetSession(pb.GetSessionRequest(session_id=request.session_id))
        assert [s.kind for s in state.spans] == [common_pb2.SPAN_KIND_PROMPT, GENERATED]
        assert list(state.token_ids) == [*again.prompt_token_ids, *again.first_turn.token_ids]
        # answered once: a second retry repeats the same turn, and the episode goes on
        assert await sessions.OpenSession(request, timeout=60) == again
        second = await sessions.Generate(pb.GenerateRequest(session_id=request.session_id,
                                                            sampling=common_pb2.SamplingParams(max_new_tokens=4)))
        assert second.span_index == 2
        await sessions.AbortSession(pb.AbortSessionRequest(session_id=request.session_id))


async def test_sessions_of_a_killed_engine_continue_on_the_other_engine_and_the_reroute_is_reported(rollout):
    async with channel(rollout.session.address) as ch, channel(rollout.gateway.address) as gch:
        sessions = session_pb2_grpc.SessionServiceStub(ch)
        gateway = gateway_pb2_grpc.GatewayServiceStub(gch)
        opened = [await sessions.OpenSession(open_request(seed)) for seed in range(4)]
        engine_of = {}
        for session in opened:
            engine_of[session.session_id] = (await sessions.Generate(
                pb.GenerateRequest(session_id=session.session_id))).engine_id
        assert sorted(engine_of.values()) == ["e0", "e0", "e1", "e1"]
        on_e1 = [s for s, e in engine_of.items() if e == "e1"]
        before = reroutes_counted(rollout)

        # Kill e1 while it is generating a long turn for one of its sessions.
        victim = rollout.engines["e1"]
        long_request = pb.GenerateRequest(
            session_id=on_e1[0],
            sampling=common_pb2.SamplingParams(max_new_tokens=900, ignore_eos=True, seed=3))

        async def long_generate():
            return await sessions.Generate(long_request)

        long_turn = asyncio.create_task(long_generate())

        async def e1_is_generating() -> bool:
            status, load = await http_call(victim.url, "/server_info", method="GET")
            return status == 200 and load["num_running_reqs"] >= 1 and load["generated_tokens"] > 0

        await eventually(e1_is_generating, within_s=20)
        victim.process.kill()
        victim.process.wait(timeout=10)
        rescued = await long_turn
        assert rescued.engine_id == "e0" and len(rescued.token_ids) == 900

        # The other session of e1, through the gateway directly: the reroute is in the reply.
        direct = await gateway.Generate(gateway_pb2.GenerateRequest(
            session_id=on_e1[1], input_ids=[1, 40, 41], sampling=common_pb2.SamplingParams(max_new_tokens=2),
            return_logprob=True))
        assert direct.rerouted and direct.engine_id == "e0" and "engine e1" in direct.reroute_reason
        # Later turns of every session run on e0; sessions of e0 never moved.
        for session_id in engine_of:
            assert (await sessions.Generate(pb.GenerateRequest(session_id=session_id))).engine_id == "e0"
        listed = {e.engine_id: e
                  for e in (await gateway.ListEngines(gateway_pb2.ListEnginesRequest())).engines}
        assert listed["e1"].state == gateway_pb2.ENGINE_STATE_UNHEALTHY and listed["e1"].last_error
        trajectory = (await sessions.CloseSession(pb.CloseSessionRequest(session_id=on_e1[0],
                                                                         return_trajectory=True))).trajectory
    assert [s.engine_id for s in trajectory.spans if s.kind == GENERATED] == ["e1", "e0", "e0"]
    assert reroutes_counted(rollout) - before >= 2  # the killed request and the direct call at least
