"""Adapter versions through the broker: shipped as adapters, canaried beside the accepted one on the
same engines, promoted and rolled back by switching the gateway's adapter routes (no weight copy).

The engines are HTTP stand-ins answering SGLang 0.5.23's LoRA routes the way SGLang does
(`/load_lora_adapter`, `/unload_lora_adapter`: `{success, error_message, loaded_adapters}`, 400 on a
refusal, a name loaded twice refused), `/v1/models` (each loaded adapter a model card with `parent`)
and `/model_info`; any other route is a 404, so a weight copy
would show. Redis is real (the routes the gateway reads, the broker's registry)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from rlfleet.api.broker.v1 import broker_pb2
from rlfleet.broker.adapters import lora_name
from rlfleet.broker.broker import Broker
from rlfleet.broker.config import WeightBrokerConfig
from rlfleet.broker.metrics import BrokerMetrics
from rlfleet.broker.pools import Pools
from rlfleet.broker.registry import VersionRegistry
from rlfleet.broker.testing import policy_version
from rlfleet.common.adapter_routes import AdapterRoute, AdapterRoutes
from rlfleet.common.engine_client import EngineTimeouts
from rlfleet.common.testing import unique_run_id
from rlfleet.weights import DirectoryWeightStore
from rlfleet.weights.adapter import ADAPTER_FILE

State = broker_pb2.VersionState
RANK = 4
CONFIG = {"peft_type": "LORA", "r": RANK, "lora_alpha": 8.0, "target_modules": ["q_proj"], "bias": "none"}
Q = "model.layers.0.self_attn.q_proj.weight"


class SGLangLoRAStandIn:
    """One engine: base weights at `weight_version`, adapters loaded by name. `routes_at_unload` keeps
    what the gateway's routes said at each unload (the switch must come first)."""

    def __init__(self, routes: AdapterRoutes) -> None:
        self.loaded: dict[str, str] = {}
        self.calls: list[tuple[str, str]] = []
        self.routes = routes
        self.routes_at_unload: list[dict[str, int]] = []
        self.url = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/model_info", self.model_info)
        app.router.add_post("/load_lora_adapter", self.load)
        app.router.add_post("/unload_lora_adapter", self.unload)
        app.router.add_get("/v1/models", self.models)
        return app

    async def models(self, request: web.Request) -> web.Response:
        """SGLang 0.5.23's available_models: the base model's card, then one per registered adapter."""
        cards = [{"id": "base", "object": "model", "root": "base", "parent": None, "max_model_len": 64}]
        cards += [{"id": name, "object": "model", "root": path, "parent": "base", "max_model_len": None}
                  for name, path in self.loaded.items()]
        return web.json_response({"object": "list", "data": cards})

    def restart(self) -> None:
        """Killed and started again on the same address, on the base version: it holds no adapter and
        remembers none (SGLang's lora_ref_cache starts empty)."""
        self.loaded.clear()

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "base", "weight_version": "0", "is_generation": True})

    def reply(self, ok: bool, error: str = "") -> web.Response:
        return web.json_response({"success": ok, "error_message": error,
                                  "loaded_adapters": dict(self.loaded)},
                                 status=200 if ok else 400)

    async def load(self, request: web.Request) -> web.Response:
        body = await request.json()
        name, path = body["lora_name"], Path(body["lora_path"])
        self.calls.append(("load", name))
        if name in self.loaded:
            return self.reply(False, f"The lora name {name} is already loaded")
        if not (path / "adapter_config.json").is_file() or not (path / ADAPTER_FILE).is_file():
            return self.reply(False, f"{path} is not a LoRA adapter directory")
        self.loaded[name] = str(path)
        return self.reply(True)

    async def unload(self, request: web.Request) -> web.Response:
        name = (await request.json())["lora_name"]
        self.calls.append(("unload", name))
        self.routes_at_unload.append({role: r.version for role, r in (await self.routes.all()).items()})
        if name not in self.loaded:
            return self.reply(False, f"LoRA adapter {name} is not loaded")
        del self.loaded[name]
        return self.reply(True)


@pytest.fixture
async def setup(tmp_path, redis_url):
    run = unique_run_id("ad")
    redis = aioredis.from_url(redis_url)
    routes = AdapterRoutes(redis, run)
    engines, runners = {}, []
    for engine_id in ("c0", "f0"):
        stand_in = SGLangLoRAStandIn(routes)
        runner = web.AppRunner(stand_in.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        stand_in.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        engines[engine_id], runners = stand_in, [*runners, runner]
    store = DirectoryWeightStore(tmp_path / "weights", run)
    rng = np.random.default_rng(0)
    store.write_version(0, {Q: rng.standard_normal((16, 12)).astype(np.float32),
                            "model.norm.weight": np.ones(12, dtype=np.float32)})
    config = WeightBrokerConfig(run_id=run, weight_store=str(tmp_path / "weights"),
                                consume_policy_stream=False,
                                engines=[{"engine_id": e, "url": s.url,
                                          "pool": "canary" if e == "c0" else "fleet",
                                          "kind": "sglang"} for e, s in engines.items()])
    pools = Pools(config.engines, None, EngineTimeouts(weights_s=10))
    broker = Broker(config, VersionRegistry(redis, run), store, pools, None, BrokerMetrics())
    yield broker, store, routes, engines
    await pools.close()
    for runner in runners:
        await runner.cleanup()
    await redis.aclose()


def write_adapter(store: DirectoryWeightStore, version: int) -> None:
    rng = np.random.default_rng(version)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    store.write_adapter(version,
                        {f"{prefix}.lora_A.weight": rng.standard_normal((RANK, 12)).astype(np.float32),
                         f"{prefix}.lora_B.weight": rng.standard_normal((16, RANK)).astype(np.float32)},
                        CONFIG, base_version=0)


async def announce(broker: Broker, store: DirectoryWeightStore, version: int) -> None:
    if version:
        write_adapter(store, version)
    await broker.announce(policy_version(store.manifest(version)))
    await broker.reconcile_once()


async def state(broker: Broker, version: int) -> int:
    return (await broker.registry.get(version)).state


async def routed(routes: AdapterRoutes) -> dict[str, int]:
    return {role: r.version for role, r in (await routes.all()).items()}


async def test_a_candidate_adapter_is_served_beside_the_accepted_one_and_promotion_is_a_route_switch(setup):
    broker, store, routes, engines = setup
    await announce(broker, store, 0)  # the base, served as it is
    await broker.promote(0, "base")
    await announce(broker, store, 1)
    assert await state(broker, 1) == State.VERSION_STATE_CANARY
    # Loaded on every engine, fleet ones too (canary without a second engine), from the store's directory.
    assert all(e.loaded == {"v1": str(store.path(1))} for e in engines.values())
    assert await routes.all() == {"canary": AdapterRoute("v1", 1)}  # the fleet role stays on the base

    await broker.promote(1, "gate passed")
    await broker.reconcile_once()
    assert await routed(routes) == {"canary": 1, "fleet": 1}
    await announce(broker, store, 2)
    assert await routed(routes) == {"canary": 2, "fleet": 1}
    assert all(set(e.loaded) == {"v1", "v2"} for e in engines.values())  # candidate beside the accepted one

    await broker.promote(2, "gate passed")
    await broker.reconcile_once()
    assert await routed(routes) == {"canary": 2, "fleet": 2}
    for engine in engines.values():
        assert engine.calls == [("load", "v1"), ("load", "v2"), ("unload", "v1")]  # nothing copied twice
        assert engine.routes_at_unload == [{"canary": 2, "fleet": 2}]  # unloaded only after the switch
    status = await broker.status()
    assert (status.canary_version, status.fleet_version) == (2, 2)
    assert {(e.engine_id, e.policy_version, e.state) for e in status.engines} == {("c0", 2, "serving"),
                                                                                 ("f0", 2, "serving")}


async def test_rollback_switches_the_routes_back_to_the_accepted_adapter_and_unloads_the_candidate(setup):
    broker, store, routes, engines = setup
    await announce(broker, store, 0)
    await broker.promote(0, "base")
    for version in (1, 2):
        await announce(broker, store, version)
        await broker.promote(version, "gate passed")
        await broker.reconcile_once()
    await announce(broker, store, 3)
    assert await routed(routes) == {"canary": 3, "fleet": 2}

    assert await broker.rollback(0, "regression set failed") == 2  # the candidate off, the accepted one stays
    await broker.reconcile_once()
    assert await routed(routes) == {"canary": 2, "fleet": 2}
    assert await state(broker, 3) == State.VERSION_STATE_REJECTED
    for engine in engines.values():
        assert set(engine.loaded) == {"v2"} and engine.calls[-1] == ("unload", "v3")  # no load: a switch
        assert engine.routes_at_unload[-1] == {"canary": 2, "fleet": 2}  # unloaded after the switch

    assert await broker.rollback(0, "regression in production") == 1  # an older accepted adapter comes back
    await broker.reconcile_once()
    assert await routed(routes) == {"canary": 1, "fleet": 1}
    assert await state(broker, 2) == State.VERSION_STATE_ROLLED_BACK
    for engine in engines.values():
        assert set(engine.loaded) == {"v1"} and engine.calls[-2:] == [("load", "v1"), ("unload", "v2")]
        assert engine.routes_at_unload[-1] == {"canary": 1, "fleet": 1}


async def serve_an_accepted_adapter(broker, store) -> None:
    """v0 the base, v1 an adapter on it, accepted (the fleet's route) and served everywhere."""
    await announce(broker, store, 0)
    await broker.promote(0, "base")
    await announce(broker, store, 1)
    await broker.promote(1, "gate passed")
    await broker.reconcile_once()


async def test_an_adapter_whose_files_fail_their_checksums_is_rejected_and_never_routed(setup):
    broker, store, routes, engines = setup
    await serve_an_accepted_adapter(broker, store)
    write_adapter(store, 2)
    payload = store.path(2) / ADAPTER_FILE
    data = bytearray(payload.read_bytes())
    data[-5] ^= 0x5A
    payload.write_bytes(bytes(data))
    await broker.announce(policy_version(store.manifest(2)))
    await broker.reconcile_once()
    assert await state(broker, 2) == State.VERSION_STATE_REJECTED
    await broker.reconcile_once()
    assert await routed(routes) == {"canary": 1, "fleet": 1}
    assert all(("load", lora_name(2)) not in e.calls for e in engines.values())


async def test_a_restarted_broker_takes_already_loaded_adapters_as_held(setup):
    broker, store, routes, engines = setup
    await announce(broker, store, 0)
    await broker.promote(0, "base")
    await announce(broker, store, 1)
    fresh = Broker(broker.config, broker.registry, store, broker.pools, None, BrokerMetrics())
    await fresh.adapters.load_routes()
    await fresh.reconcile_once()
    assert await routed(routes) == {"canary": 1}
    assert all(set(e.loaded) == {"v1"} and ("unload", "v1") not in e.calls for e in engines.values())


async def test_a_rollback_to_the_full_base_clears_the_routes_and_unloads_every_adapter(setup):
    broker, store, routes, engines = setup
    await announce(broker, store, 0)
    await broker.promote(0, "base")
    await announce(broker, store, 1)
    assert await routed(routes) == {"canary": 1}
    assert await broker.rollback(0, "candidate refused") == 0
    await broker.reconcile_once()
    assert await routes.all() == {}  # every role on the base model again
    assert all(e.loaded == {} and e.routes_at_unload == [{}] for e in engines.values())


async def test_an_engine_restarted_without_its_adapters_loads_them_again_in_the_next_round(setup):
    broker, store, routes, engines = setup
    await serve_an_accepted_adapter(broker, store)
    await announce(broker, store, 2)
    assert await routed(routes) == {"canary": 2, "fleet": 1}
    engines["f0"].restart()  # its base version is still the target's: no base reload would forget it
    calls = {e: list(s.calls) for e, s in engines.items()}
    await broker.reconcile_once()
    assert engines["f0"].loaded == {"v1": str(store.path(1)), "v2": str(store.path(2))}
    assert engines["f0"].calls[len(calls["f0"]):] == [("load", "v1"), ("load", "v2")]
    assert engines["c0"].calls == calls["c0"]  # the engine that kept its adapters is left alone
    assert await routed(routes) == {"canary": 2, "fleet": 1}
    status = await broker.status()
    assert {(e.engine_id, e.state) for e in status.engines} == {("c0", "serving"), ("f0", "serving")}


async def test_with_a_trainer_sent_transport_an_adapter_still_goes_by_the_store_at_once(setup):
    """No trainer sends adapters (they are a few hundred KB: the store directory is the transport), so
    on a broker whose engines take full versions straight from the trainer an adapter version must not
    wait `trainer_wait_s` for a send that never comes."""
    broker, store, routes, engines = setup
    config = broker.config.model_copy(update={
        "engines": [e.model_copy(update={"transport": "p2p"}) for e in broker.config.engines],
        "sync": broker.config.sync.model_copy(update={"trainer_wait_s": 3600.0})})
    sending = Broker(config, broker.registry, store, broker.pools, None, BrokerMetrics())
    assert sending._trainer_decides
    await sending.announce(policy_version(store.manifest(0)))
    async with sending._lock:  # what StartTrainerSync does for the full base version the trainer sends
        assert await sending._apply_policy(only=0) == 0
    await sending.reconcile_once()  # the stand-ins serve version 0 already: nothing is sent
    await sending.promote(0, "base")
    await sending.reconcile_once()
    write_adapter(store, 1)
    await sending.announce(policy_version(store.manifest(1)))
    await sending.reconcile_once()
    assert await routed(routes) == {"canary": 1}
    assert all(e.loaded == {"v1": str(store.path(1))} for e in engines.values())
