"""LoRA end to end below the RL loop: the trainer's torch backend trains an adapter, the weight store
holds it as an adapter version on the base, and the broker ships it to real CPU engine processes,
where it is served beside the accepted adapter; promotion and rollback switch the gateway's adapter
routes and never reload the base weights. An engine killed and started again on the same port (too fast
for the broker to see it down) is given its adapters back within one round."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
import torch

from rlfleet.broker.broker import Broker
from rlfleet.broker.config import WeightBrokerConfig
from rlfleet.broker.metrics import BrokerMetrics
from rlfleet.broker.pools import Pools
from rlfleet.broker.registry import VersionRegistry
from rlfleet.broker.testing import policy_version
from rlfleet.common.adapter_routes import AdapterRoutes
from rlfleet.common.engine_client import EngineClient, EngineRejected, EngineTimeouts, adapter_missing
from rlfleet.common.testing import unique_run_id
from rlfleet.engine.testing import EngineProcess, build_tiny_model, merged_lora_model, token_logprobs
from rlfleet.trainer.config import BatchConfig, LossConfig, TorchBackendConfig
from rlfleet.trainer.objectives import rl_step
from rlfleet.trainer.testing import make_samples
from rlfleet.trainer.torch_backend import TorchBackend
from rlfleet.weights import DirectoryWeightStore

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=1)


class LoraTrainer:
    """The trainer's own backend with [trainer.lora], publishing as the service does (loop.py)."""

    def __init__(self, model_dir, store: DirectoryWeightStore) -> None:
        self.backend = TorchBackend(TorchBackendConfig(model_dir=str(model_dir), seed=0,
                                                       lora={"enabled": True, "rank": 4, "alpha": 8.0},
                                                       optim={"lr": 2e-2}, batch={"pack_length": 64}))
        self.store = store
        self.version = 0
        store.write_version(0, self.backend.base_state_for_export())

    def step_and_publish(self) -> int:
        rl_step(self.backend,
                make_samples(2, 4, vocab_size=self.backend.lm_config.vocab_size, seed=self.version),
                LossConfig(), BatchConfig(pack_length=64))
        self.version += 1
        tensors, config = self.backend.adapter_for_export()
        self.store.write_adapter(self.version, tensors, config, base_version=0)
        return self.version


class LoraFleet:
    """The broker of one run over engines c0 (canary pool) and f0 (fleet pool), and its adapter routes."""

    def __init__(self, run: str, store: DirectoryWeightStore, store_root, urls: dict[str, str],
                 redis_url) -> None:
        config = WeightBrokerConfig(run_id=run, weight_store=str(store_root), consume_policy_stream=False,
                                    engines=[{"engine_id": e, "url": url,
                                              "pool": "canary" if e == "c0" else "fleet",
                                              "kind": "cpu"} for e, url in urls.items()])
        self.store = store
        self.redis = aioredis.from_url(redis_url)
        self.pools = Pools(config.engines, None, EngineTimeouts(weights_s=60))
        self.broker = Broker(config, VersionRegistry(self.redis, run), store, self.pools, None,
                             BrokerMetrics())
        self.routes = AdapterRoutes(self.redis, run)

    async def publish(self, version: int) -> None:
        await self.broker.announce(policy_version(self.store.manifest(version)))
        await self.broker.reconcile_once()

    async def serve_base(self) -> None:
        """Version 0, the base, loaded in full from the store and accepted."""
        await self.publish(0)
        await self.broker.promote(0, "base")
        await self.broker.reconcile_once()

    async def accept_one_adapter_and_offer_another(self, trainer: LoraTrainer) -> None:
        """v1 trained and accepted (the fleet's), v2 trained and the candidate (the canary's)."""
        await self.publish(trainer.step_and_publish())
        await self.broker.promote(1, "gate passed")
        await self.publish(trainer.step_and_publish())

    async def routed(self) -> dict[str, int]:
        return {r: x.version for r, x in (await self.routes.all()).items()}

    async def updates(self) -> dict[str, int]:
        return {e.engine_id: e.updates for e in (await self.broker.status()).engines}

    async def close(self) -> None:
        await self.pools.close()
        await self.redis.aclose()


async def test_trained_adapters_are_served_beside_each_other_and_switched_without_a_weight_copy(
        model_dir, store_root, engines, redis_url):
    run = unique_run_id("la")
    store = DirectoryWeightStore(store_root, run, base_dir=str(model_dir))
    trainer = LoraTrainer(model_dir, store)
    fleet = LoraFleet(run, store, store_root, {e: p.url for e, p in engines.items()}, redis_url)
    clients = {e: EngineClient(p.url) for e, p in engines.items()}
    try:
        await fleet.serve_base()
        assert {e: await c.weight_version() for e, c in clients.items()} == {"c0": "0", "f0": "0"}
        base_loads = await fleet.updates()

        await fleet.accept_one_adapter_and_offer_another(trainer)
        assert await fleet.routed() == {"canary": 2, "fleet": 1}
        # Both adapters on both engines at once; each gives the log-probs of its peft-merged model.
        for client in clients.values():
            for version in (1, 2):
                out = await client.generate(PROMPT, GREEDY, lora_path=f"v{version}")
                reference = merged_lora_model(store.path(0), store.path(version))
                want = token_logprobs(reference, PROMPT + out.output_ids)[-len(out.output_ids):]
                assert max(abs(a - b) for a, b in zip(out.output_logprobs, want, strict=True)) <= 1e-4
        candidate = (await clients["f0"].generate(PROMPT, GREEDY, lora_path="v2")).output_logprobs
        accepted = (await clients["f0"].generate(PROMPT, GREEDY, lora_path="v1")).output_logprobs
        assert candidate != accepted

        assert await fleet.broker.rollback(0, "regression set failed") == 1
        await fleet.broker.reconcile_once()
        assert await fleet.routed() == {"canary": 1, "fleet": 1}
        status = await fleet.broker.status()
        assert {(e.engine_id, e.policy_version) for e in status.engines} == {("c0", 1), ("f0", 1)}
        # No base reload, on any engine, since version 0: adapters were loaded, switched and unloaded only.
        assert await fleet.updates() == base_loads
        assert {e: await c.weight_version() for e, c in clients.items()} == {"c0": "0", "f0": "0"}
    finally:
        for client in clients.values():
            await client.close()
        await fleet.close()


async def test_an_engine_restarted_on_its_address_gets_both_adapters_back_within_a_round(
        model_dir, store_root, redis_url, tmp_path):
    """Engines that start on the base version, as `rlfleet run` starts them (weight_version 0): after a
    kill -9 and a restart on the same port the engine's version is still the target's base, so no base
    reload tells the broker anything; only what the engine says it holds does."""
    run = unique_run_id("lr")
    store = DirectoryWeightStore(store_root, run, base_dir=str(model_dir))
    trainer = LoraTrainer(model_dir, store)
    procs = {e: EngineProcess(model_dir, tmp_path / e, weight_store_root=store_root, engine_id=e,
                              weight_version="0").start() for e in ("c0", "f0")}  # fmt: skip
    fleet = LoraFleet(run, store, store_root, {e: p.url for e, p in procs.items()}, redis_url)
    client = EngineClient(procs["f0"].url)

    async def served() -> dict[str, tuple[list[int], list[float]]]:
        outs = {name: await client.generate(PROMPT, GREEDY, lora_path=name) for name in ("v1", "v2")}
        return {name: (out.output_ids, out.output_logprobs) for name, out in outs.items()}

    try:
        await fleet.serve_base()
        await fleet.accept_one_adapter_and_offer_another(trainer)
        assert await fleet.routed() == {"canary": 2, "fleet": 1}
        before = await served()
        assert before["v1"] != before["v2"]
        updates = await fleet.updates()

        port = procs["f0"].port
        procs["f0"].kill()  # SIGKILL, and back on the same address before any broker round
        procs["f0"].config["port"] = port
        procs["f0"].start()
        assert procs["f0"].url == client.base_url
        assert await client.weight_version() == "0" and await client.loaded_adapters() == {}
        with pytest.raises(EngineRejected) as missing:  # what the gateway gets until the broker repairs it
            await client.generate(PROMPT, GREEDY, lora_path="v1")
        assert missing.value.status == 400 and adapter_missing(missing.value)

        await fleet.broker.reconcile_once()  # one round
        assert await client.loaded_adapters() == {"v1": str(store.path(1)), "v2": str(store.path(2))}
        assert await fleet.routed() == {"canary": 2, "fleet": 1}
        assert await served() == before  # same tokens, same log-probs as before the kill
        # Adapters only: the broker reloaded no base weights (the engine restarted on them).
        assert await fleet.updates() == updates
        assert {(e.engine_id, e.state) for e in (await fleet.broker.status()).engines} == {("c0", "serving"),
                                                                                            ("f0", "serving")}
    finally:
        await client.close()
        await fleet.close()
        for proc in procs.values():
            proc.stop()
