"""The gateway in-process over gRPC, against real Redis and a real CPU engine.

Several engine ids can point at the one engine process: routing tells them apart by id. A dead
engine is a URL nobody listens on; a hung one is a small HTTP server that never answers /generate.
"""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from aiohttp import web

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.gateway.v1 import gateway_pb2 as pb
from rlfleet.common.adapter_routes import AdapterRoute, AdapterRoutes
from rlfleet.common.engine_client import EngineClient
from rlfleet.common.redis_store import key
from rlfleet.engine.testing import EngineProcess, make_lora_adapter

from .conftest import running_gateway

pytestmark = pytest.mark.integration

PROMPT = [1, 40, 41, 42, 43]


def generate(session_id: str = "", max_new_tokens: int = 4, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(session_id=session_id, input_ids=PROMPT, return_logprob=True,
                              sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens,
                                                                 seed=1, **sampling))


def dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


async def engines_by_id(gateway) -> dict[str, pb.Engine]:
    return {e.engine_id: e for e in (await gateway.stub.ListEngines(pb.ListEnginesRequest())).engines}


async def test_generate_returns_tokens_logprobs_and_the_engines_policy_version(redis_url, engine_url):
    async with running_gateway(redis_url, {"e0": engine_url}) as gateway:
        reply = await gateway.stub.Generate(generate("s1", max_new_tokens=6, ignore_eos=True))
    assert len(reply.output_ids) == len(reply.output_logprobs) == 6
    assert all(lp <= 0 for lp in reply.output_logprobs)
    assert reply.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (reply.engine_id, reply.policy_version, reply.prompt_tokens) == ("e0", 3, len(PROMPT))
    assert reply.latency_s > 0 and not reply.rerouted
    # meta_info.weight_versions, carried over: one range of the engine's version over every token.
    assert [(r.policy_version, r.start, r.end) for r in reply.version_ranges] == [(3, 0, 6)]


async def test_every_turn_of_a_session_goes_to_its_engine_and_new_sessions_spread_out(redis_url, engine_url):
    async with running_gateway(redis_url, {"e0": engine_url, "e1": engine_url}) as gateway:
        first = {s: (await gateway.stub.Generate(generate(s))).engine_id for s in ("a", "b", "c", "d")}
        assert sorted(first.values()) == ["e0", "e0", "e1", "e1"]  # least loaded: two sessions each
        for _turn in range(3):
            for session_id, engine_id in first.items():
                assert (await gateway.stub.Generate(generate(session_id))).engine_id == engine_id
        listed = await engines_by_id(gateway)
        assert listed["e0"].sessions == listed["e1"].sessions == 2
        await gateway.stub.Release(pb.ReleaseRequest(session_id="a"))
        assert (await engines_by_id(gateway))[first["a"]].sessions == 1


async def test_a_failed_engine_is_marked_unhealthy_and_the_turn_is_rerouted_once(redis_url, engine_url):
    dead = dead_url()
    async with running_gateway(redis_url, {"live": engine_url, "dead": dead},
                               health_interval_s=60) as gateway:
        # The dead engine passed its last probe and the session is affine to it: it dies before the
        # next probe.
        await gateway.redis.hset(key(gateway.run_id, "engine", "dead"), "healthy", "1")
        await gateway.app.registry.refresh()
        await gateway.redis.set(key(gateway.run_id, "affinity", "s"), "dead")
        reply = await gateway.stub.Generate(generate("s"))
        assert reply.rerouted and reply.engine_id == "live"
        assert reply.reroute_reason.startswith("engine dead failed:") and "Connect" in reply.reroute_reason
        dead_engine = (await engines_by_id(gateway))["dead"]
        assert dead_engine.state == pb.ENGINE_STATE_UNHEALTHY and dead_engine.last_error
        again = await gateway.stub.Generate(generate("s"))  # the new affinity holds
        assert again.engine_id == "live" and not again.rerouted


async def test_a_session_whose_engine_went_unhealthy_moves_with_the_reason(redis_url, engine_url):
    async with running_gateway(redis_url, {"live": engine_url, "dead": dead_url()}) as gateway:
        await gateway.redis.set(key(gateway.run_id, "affinity", "s"), "dead")  # the probe found it dead
        reply = await gateway.stub.Generate(generate("s"))
    assert reply.rerouted and reply.engine_id == "live"
    assert reply.reroute_reason.startswith("engine dead is unhealthy:")


async def test_no_engine_to_route_to_is_unavailable_with_a_clear_message(redis_url):
    async with running_gateway(redis_url, {}) as gateway:
        with pytest.raises(grpc.aio.AioRpcError) as none:
            await gateway.stub.Generate(generate("s"))
        await gateway.stub.RegisterEngine(pb.RegisterEngineRequest(engine_id="gone", url=dead_url()))
        with pytest.raises(grpc.aio.AioRpcError) as dead:
            await gateway.stub.Generate(generate("s"))
    assert none.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no engine is registered with the gateway" in none.value.details()
    assert dead.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "gone: unhealthy" in dead.value.details()


async def test_an_engine_rejection_is_invalid_argument_with_the_engines_message(redis_url, engine_url):
    async with running_gateway(redis_url, {"e0": engine_url}) as gateway:
        bad = generate("s")
        bad.input_ids[:] = [1, 100_000]
        with pytest.raises(grpc.aio.AioRpcError) as rejected:
            await gateway.stub.Generate(bad)
        with pytest.raises(grpc.aio.AioRpcError) as empty:
            await gateway.stub.Generate(pb.GenerateRequest(session_id="s", sampling=common_pb2.SamplingParams(
                max_new_tokens=2)))
        with pytest.raises(grpc.aio.AioRpcError) as no_tokens:
            await gateway.stub.Generate(generate("s", max_new_tokens=0))
        assert (await engines_by_id(gateway))["e0"].state == pb.ENGINE_STATE_HEALTHY  # not the engine's fault
    assert rejected.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input_ids[1] = 100000 is outside the vocabulary" in rejected.value.details()
    assert empty.value.code() == no_tokens.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input_ids is empty" in empty.value.details()
    assert "max_new_tokens must be > 0" in no_tokens.value.details()


async def test_pause_and_resume_answer_per_engine_and_show_in_the_registry(redis_url, engine_url):
    async with running_gateway(redis_url, {"e0": engine_url, "dead": dead_url()}) as gateway:
        paused = await gateway.stub.PauseEngines(pb.PauseEnginesRequest(mode=pb.PAUSE_MODE_RETRACT))
        results = {r.engine_id: r for r in paused.results}
        assert results["e0"].ok and not results["dead"].ok and results["dead"].message
        assert (await engines_by_id(gateway))["e0"].state == pb.ENGINE_STATE_PAUSED
        unknown = await gateway.stub.ResumeEngines(pb.ResumeEnginesRequest(engine_ids=["e0", "nope"]))
        assert [(r.engine_id, r.ok) for r in unknown.results] == [("e0", True), ("nope", False)]
        assert (await engines_by_id(gateway))["e0"].state == pb.ENGINE_STATE_HEALTHY
        assert (await gateway.stub.Generate(generate("s"))).engine_id == "e0"  # it serves again


async def test_registrations_are_shared_by_gateway_replicas_and_draining_takes_no_new_sessions(
        redis_url, engine_url):
    async with running_gateway(redis_url, {"e0": engine_url}) as first:
        async with running_gateway(redis_url, {}, run_id=first.run_id) as second:
            added = await second.stub.RegisterEngine(pb.RegisterEngineRequest(
                engine_id="e1", url=engine_url, pool=pb.ENGINE_POOL_CANARY, labels={"zone": "a"},
                start_draining=True))
            assert (added.state, added.policy_version, added.pool) == (pb.ENGINE_STATE_DRAINING, 3,
                                                                        pb.ENGINE_POOL_CANARY)
            seen = await engines_by_id(first)
            assert set(seen) == {"e0", "e1"} and seen["e1"].labels["zone"] == "a"
            for session in ("a", "b", "c"):
                assert (await first.stub.Generate(generate(session))).engine_id == "e0"
            # A replica routes a session the way another one placed it.
            assert (await second.stub.Generate(generate("a"))).engine_id == "e0"
            await second.stub.RegisterEngine(pb.RegisterEngineRequest(engine_id="e1", url=engine_url))
            assert (await engines_by_id(first))["e1"].state == pb.ENGINE_STATE_HEALTHY
            await first.stub.DeregisterEngine(pb.DeregisterEngineRequest(engine_id="e1"))
            assert set(await engines_by_id(second)) == {"e0"}
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await first.stub.DeregisterEngine(pb.DeregisterEngineRequest(engine_id="e1"))
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await first.stub.RegisterEngine(pb.RegisterEngineRequest(engine_id="x", url="127.0.0.1:1"))
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "url" in bad.value.details()


async def test_admission_refuses_beyond_the_inflight_budget_and_a_release_frees_a_slot(redis_url, engine_url):
    async with running_gateway(redis_url, {"e0": engine_url}, max_inflight_sessions=2,
                               retry_after_ms=250) as gateway:
        admit = [await gateway.stub.Admit(pb.AdmitRequest(session_id=s)) for s in ("a", "b", "c")]
        assert [a.admitted for a in admit] == [True, True, False]
        assert (admit[2].reason, admit[2].retry_after_ms) == ("inflight_limit", 250)
        assert (await gateway.stub.Admit(pb.AdmitRequest(session_id="a"))).admitted  # a retried admit
        await gateway.stub.Release(pb.ReleaseRequest(session_id="a"))
        assert (await gateway.stub.Admit(pb.AdmitRequest(session_id="c"))).admitted
        status = await gateway.stub.GetAdmissionStatus(pb.GetAdmissionStatusRequest())
    assert (status.inflight_sessions, status.admitted_total, status.refused_total) == (2, 3, 1)
    assert dict(status.refused_by_reason) == {"inflight_limit": 1}
    assert status.policy.max_inflight_sessions == 2


async def test_admission_refuses_new_sessions_while_the_fleet_is_too_stale(redis_url, engine_url):
    async with running_gateway(redis_url, {"e0": engine_url}) as gateway:  # the engine serves version 3
        status = await gateway.stub.SetAdmissionPolicy(pb.AdmissionPolicy(trainer_version=6, max_staleness=2))
        assert status.fleet_min_version == 3
        refused = await gateway.stub.Admit(pb.AdmitRequest(session_id="s"))
        assert not refused.admitted and refused.reason == "stale" and refused.retry_after_ms > 0
        await gateway.stub.SetAdmissionPolicy(pb.AdmissionPolicy(trainer_version=5, max_staleness=2))
        assert (await gateway.stub.Admit(pb.AdmitRequest(session_id="s"))).admitted
        await gateway.stub.SetAdmissionPolicy(pb.AdmissionPolicy(trainer_version=50, max_staleness=-1))
        assert (await gateway.stub.Admit(pb.AdmitRequest(session_id="t"))).admitted  # staleness off
        status = await gateway.stub.GetAdmissionStatus(pb.GetAdmissionStatusRequest())
        with pytest.raises(grpc.aio.AioRpcError) as other_run:
            await gateway.stub.Admit(pb.AdmitRequest(session_id="u", run_id="another-run"))
    assert dict(status.refused_by_reason) == {"stale": 1}
    assert other_run.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture
async def hung_engine():
    """Answers health and version, never finishes a /generate."""
    async def version(request):
        return web.json_response({"weight_version": "3"})

    async def ok(request):
        return web.json_response({})

    async def hang(request):
        await asyncio.sleep(3600)

    app = web.Application()
    async def loads(request):
        return web.json_response({"loads": [{"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0}]})

    app.router.add_get("/model_info", version)
    app.router.add_get("/health", ok)
    app.router.add_get("/v1/loads", loads)
    app.router.add_post("/generate", hang)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    await runner.cleanup()


async def test_a_hung_engine_times_out_and_the_turn_goes_elsewhere(redis_url, engine_url, hung_engine):
    async with running_gateway(redis_url, {"hung": hung_engine, "live": engine_url}, generate_timeout_s=1.0,
                               health_interval_s=60) as gateway:
        await gateway.redis.set(key(gateway.run_id, "affinity", "s"), "hung")
        reply = await gateway.stub.Generate(generate("s"))
    assert reply.rerouted and reply.engine_id == "live"
    assert "engine hung failed" in reply.reroute_reason and "Timeout" in reply.reroute_reason


async def test_an_engine_can_be_drained_and_undrained_by_the_weight_broker(redis_url, engine_url):
    async with running_gateway(redis_url, {"e0": engine_url, "e1": engine_url}) as gateway:
        drained = await gateway.stub.UpdateEngineState(pb.UpdateEngineStateRequest(
            engine_id="e1", state=pb.ENGINE_STATE_DRAINING, reason="catching up to v4"))
        assert drained.state == pb.ENGINE_STATE_DRAINING
        assert {(await gateway.stub.Generate(generate(s))).engine_id for s in "abcd"} == {"e0"}
        back = await gateway.stub.UpdateEngineState(pb.UpdateEngineStateRequest(
            engine_id="e1", state=pb.ENGINE_STATE_HEALTHY, policy_version=4))
        assert (back.state, back.policy_version) == (pb.ENGINE_STATE_HEALTHY, 4)
        assert (await gateway.stub.Generate(generate("e"))).engine_id == "e1"  # the least loaded again
        with pytest.raises(grpc.aio.AioRpcError) as bad_state:
            await gateway.stub.UpdateEngineState(pb.UpdateEngineStateRequest(
                engine_id="e1", state=pb.ENGINE_STATE_PAUSED))
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await gateway.stub.UpdateEngineState(pb.UpdateEngineStateRequest(
                engine_id="nope", state=pb.ENGINE_STATE_HEALTHY))
    assert bad_state.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


async def test_unknown_enum_values_and_huge_ids_are_clear_errors(redis_url, engine_url):
    """An enum value the proto does not define is the caller's INVALID_ARGUMENT (it was INTERNAL);
    a 4 MB id comes back clipped in a NOT_FOUND, not whole (which turned into RESOURCE_EXHAUSTED)."""
    async with running_gateway(redis_url, {"e0": engine_url}) as gateway:
        calls = [gateway.stub.UpdateEngineState(pb.UpdateEngineStateRequest(engine_id="e0", state=77)),
                 gateway.stub.PauseEngines(pb.PauseEnginesRequest(mode=77)),
                 gateway.stub.RegisterEngine(pb.RegisterEngineRequest(engine_id="e9", url=engine_url,
                                                                      kind=77)),
                 gateway.stub.Generate(pb.GenerateRequest(session_id="s", input_ids=[1], engine_pool=77))]
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await call
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad.value
            assert "77 is not a known value" in bad.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as huge:
            await gateway.stub.UpdateEngineState(pb.UpdateEngineStateRequest(
                engine_id="e" * (4 << 20), state=pb.ENGINE_STATE_HEALTHY))
    assert huge.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT), huge.value
    assert len(huge.value.details()) < 1000


async def test_an_engine_whose_load_cannot_be_read_is_unhealthy_not_stale(redis_url):
    """An engine without SGLang 0.5.23's /v1/loads (e.g. one that still answers only /get_load): the
    probe fails and says why, rather than keeping an old in-flight count."""
    async def info(request):
        return web.json_response({"weight_version": "2"})

    async def ok(request):
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/model_info", info)
    app.router.add_get("/health", ok)
    app.router.add_get("/get_load", ok)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        async with running_gateway(redis_url, {"old": url}, health_interval_s=60) as gateway:
            listed = (await engines_by_id(gateway))["old"]
    finally:
        await runner.cleanup()
    assert listed.state == pb.ENGINE_STATE_UNHEALTHY and "/v1/loads" in listed.last_error


# --- LoRA: canary and accepted adapters on the same engine ----------------------------------------
async def test_rollouts_and_candidate_evaluation_get_the_candidate_adapter_the_rest_the_accepted_one(
        redis_url, engine_url, model_dir, tmp_path):
    """One engine, in the fleet pool, serving two adapters; the gateway routes rollouts (route_pools
    canary) to the candidate without any canary engine."""
    accepted = make_lora_adapter(model_dir, tmp_path / "v4", seed=4)
    candidate = make_lora_adapter(model_dir, tmp_path / "v5", seed=5)
    params = {"max_new_tokens": 6, "sampling_seed": 1, "ignore_eos": True}
    async with EngineClient(engine_url) as engine:
        await engine.load_lora_adapter("v4", str(accepted))
        await engine.load_lora_adapter("v5", str(candidate))
        try:
            direct = {name: tuple((await engine.generate(PROMPT, params, lora_path=name)).output_ids)
                      for name in ("v4", "v5", None)}
            assert len(set(direct.values())) == 3  # three models, three answers
            async with running_gateway(redis_url, {"e0": engine_url}, route_pools=["canary"]) as gateway:
                routes = AdapterRoutes(gateway.redis, gateway.run_id)
                # No routes: by pool, as before -- and there is no canary engine for rollouts.
                unavailable = (None, grpc.StatusCode.UNAVAILABLE)
                assert await _served(gateway) == {"rollout": unavailable, "candidate": unavailable,
                                                  "accepted": (direct[None], 3)}
                await routes.set(fleet=AdapterRoute("v4", 4), canary=AdapterRoute("v5", 5))
                served = await _served(gateway)
                assert served == {"rollout": (direct["v5"], 5), "candidate": (direct["v5"], 5),
                                  "accepted": (direct["v4"], 4)}
                await routes.set(canary=None)  # rollback: the canary role falls back to the accepted adapter
                assert set((await _served(gateway)).values()) == {(direct["v4"], 4)}
                await routes.set(fleet=AdapterRoute("v5", 5))  # promotion of 5: one switch, no weight copy
                assert set((await _served(gateway)).values()) == {(direct["v5"], 5)}
                await routes.set(fleet=None)  # no routes: the base model by pool, as before
                accepted_eval = await gateway.stub.Generate(_pinned(pb.ENGINE_POOL_FLEET))
                assert (tuple(accepted_eval.output_ids), accepted_eval.policy_version) == (direct[None], 3)
        finally:
            await engine.unload_lora_adapter("v4")
            await engine.unload_lora_adapter("v5")


def _pinned(pool: int, session_id: str = "") -> pb.GenerateRequest:
    request = generate(session_id, max_new_tokens=6, ignore_eos=True)
    request.engine_pool = pool
    return request


async def _served(gateway) -> dict[str, tuple]:
    """(output ids, policy version) of a rollout, a candidate evaluation and an accepted evaluation;
    (None, code) for one the gateway could not route."""
    requests = {"rollout": _pinned(0, "roll"), "candidate": _pinned(pb.ENGINE_POOL_CANARY, "cand"),
                "accepted": _pinned(pb.ENGINE_POOL_FLEET, "acc")}
    served = {}
    for name, request in requests.items():
        try:
            reply = await gateway.stub.Generate(request)
        except grpc.aio.AioRpcError as exc:
            served[name] = (None, exc.code())
            continue
        assert {(r.policy_version, r.start, r.end) for r in reply.version_ranges} == {
            (reply.policy_version, 0, len(reply.output_ids))}
        served[name] = (tuple(reply.output_ids), reply.policy_version)
    return served


async def test_admission_staleness_counts_the_adapters_version_not_the_base_models(redis_url, engine_url):
    # the engine's base model is version 3
    async with running_gateway(redis_url, {"e0": engine_url}) as gateway:
        await AdapterRoutes(gateway.redis, gateway.run_id).set(fleet=AdapterRoute("v9", 9))
        status = await gateway.stub.SetAdmissionPolicy(
            pb.AdmissionPolicy(trainer_version=10, max_staleness=2))
        assert status.fleet_min_version == 9
        assert (await gateway.stub.Admit(pb.AdmitRequest(session_id="s"))).admitted
        await AdapterRoutes(gateway.redis, gateway.run_id).set(fleet=None)
        refused = await gateway.stub.Admit(pb.AdmitRequest(session_id="t"))
        assert not refused.admitted and refused.reason == "stale"


async def test_a_turn_on_an_engine_that_lost_its_adapter_goes_to_one_that_holds_it_or_is_unavailable(
        redis_url, engine_url, model_dir, tmp_path):
    """An engine restarted since the broker loaded the adapter there (a second real engine, holding
    none) answers 400 "never been loaded": that is not the request's fault and must not burn the
    episode, nor is the engine unhealthy."""
    adapter = make_lora_adapter(model_dir, tmp_path / "v4", seed=4)
    params = {"max_new_tokens": 4, "sampling_seed": 1}
    restarted = EngineProcess(model_dir, tmp_path / "restarted", weight_version="3").start()
    try:
        async with EngineClient(engine_url) as holder:
            await holder.load_lora_adapter("v4", str(adapter))
            try:
                want = tuple((await holder.generate(PROMPT, params, lora_path="v4")).output_ids)
                engines = {"holder": engine_url, "restarted": restarted.url}
                async with running_gateway(redis_url, engines, health_interval_s=60) as gateway:
                    await AdapterRoutes(gateway.redis, gateway.run_id).set(fleet=AdapterRoute("v4", 4))
                    await gateway.redis.set(key(gateway.run_id, "affinity", "s"), "restarted")
                    reply = await gateway.stub.Generate(generate("s"))
                    assert ((reply.engine_id, tuple(reply.output_ids), reply.policy_version)
                            == ("holder", want, 4))
                    assert reply.rerouted and "does not hold adapter v4" in reply.reroute_reason
                    again = await gateway.stub.Generate(generate("s"))  # the new affinity holds
                    assert again.engine_id == "holder" and not again.rerouted
                    assert (await engines_by_id(gateway))["restarted"].state == pb.ENGINE_STATE_HEALTHY
                async with running_gateway(redis_url, {"restarted": restarted.url}) as gateway:
                    await AdapterRoutes(gateway.redis, gateway.run_id).set(fleet=AdapterRoute("v4", 4))
                    with pytest.raises(grpc.aio.AioRpcError) as alone:
                        await gateway.stub.Generate(generate("t"))
                assert alone.value.code() == grpc.StatusCode.UNAVAILABLE  # retryable, not INVALID_ARGUMENT
                assert ("does not hold adapter v4" in alone.value.details()
                        and "retry" in alone.value.details())
            finally:
                await holder.unload_lora_adapter("v4")
    finally:
        restarted.stop()


async def test_admission_of_canary_rollouts_counts_the_candidates_adapter_else_the_accepted_one(
        redis_url, engine_url):
    """Rollouts routed to the canary: the candidate's adapter version counts; without a candidate,
    the accepted (fleet) adapter's, as the requests themselves are served (read in the admission script)."""
    async with running_gateway(redis_url, {"e0": engine_url}, route_pools=["canary"]) as gateway:
        routes = AdapterRoutes(gateway.redis, gateway.run_id)
        await routes.set(fleet=AdapterRoute("v4", 4), canary=AdapterRoute("v9", 9))
        await gateway.stub.SetAdmissionPolicy(pb.AdmissionPolicy(trainer_version=10, max_staleness=2))
        assert (await gateway.stub.Admit(pb.AdmitRequest(session_id="s"))).admitted  # the candidate, 9
        await routes.set(canary=None)
        refused = await gateway.stub.Admit(pb.AdmitRequest(session_id="t"))  # the accepted one, 4
        assert not refused.admitted and refused.reason == "stale"
        await routes.set(fleet=AdapterRoute("v8", 8))
        assert (await gateway.stub.Admit(pb.AdmitRequest(session_id="u"))).admitted


async def test_the_admission_advert_follows_the_engines_version(redis_url, engine_url):
    """What a session server admits by (rlfleet.common.session_slots): the engines' oldest version,
    the sessions' adapter role, the lease and the retry hint, kept current."""
    from rlfleet.common.session_slots import fleet_key

    # the engine's base model is version 3
    async with running_gateway(redis_url, {"e0": engine_url}) as gateway:
        advert = await gateway.redis.hgetall(fleet_key(gateway.run_id))
        assert advert == {b"engines_min_version": b"3", b"role": b"fleet", b"lease_ms": b"21600000",
                          b"retry_after_ms": b"500"}
        await gateway.stub.UpdateEngineState(pb.UpdateEngineStateRequest(
            engine_id="e0", state=pb.ENGINE_STATE_HEALTHY, policy_version=7))
        assert (await gateway.redis.hget(fleet_key(gateway.run_id), "engines_min_version")) == b"7"
        await gateway.stub.UpdateEngineState(
            pb.UpdateEngineStateRequest(engine_id="e0", state=pb.ENGINE_STATE_DRAINING))
        assert (await gateway.redis.hget(fleet_key(gateway.run_id), "engines_min_version")) == b""
