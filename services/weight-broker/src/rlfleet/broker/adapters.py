"""LoRA adapter versions on the engines: shipped as adapters, switched by route, never copied twice.

A pool target that is an adapter version (the store's `kind = "adapter"`, see rlfleet.weights.adapter)
means: every engine serves the adapter's full base version (brought there by the ordinary Rollout),
and holds the adapter loaded beside it by name. The candidate (canary target) and the accepted
adapter (fleet target) are loaded side by side on the *same* engines: canary without a second
engine. Which requests use which is the gateway's business, told through the adapter routes
(rlfleet.common.adapter_routes: role canary / fleet -> lora_name, version).

One round, in the order docs/lora-interface.md asks for:

    0. observe what every engine holds now (`/v1/models`); adapters it lost are loaded again in 1
    1. load    every wanted adapter on every engine that serves its base (`/load_lora_adapter`,
               the verified store directory as `lora_path`), unless it holds it already
    2. route   a role names an adapter only once every such engine holds it (the gateway sends the
               role's requests to any engine); a role whose target is a full version has no route
    3. unload  what no target and no route names (`/unload_lora_adapter`), after the switch

So promotion and rollback are step 2, a Redis transaction: no weight copy, no engine pause. The
broker remembers what each engine holds from the engines' own replies (both routes return every
loaded adapter); an engine it knows nothing about (a restarted broker) is asked to load each wanted
adapter, and "already loaded" counts as held. An engine whose base weights were reloaded, or that
was down, is forgotten and loads again.

An engine can also lose its adapters without the broker seeing it down or reloading its base: one
killed and started again on the same address between two rounds, on its base version (`rlfleet run`
starts CPU engines reporting version 0), comes back holding no adapter. SGLang 0.5.23 gives no boot
id or start timestamp (`/server_info`'s `startup_time` is how long start-up phases took), but its
`/v1/models` lists every loaded adapter (id = lora_name, root = lora_path, parent = the base model),
and the CPU engine serves the same list. So every round begins by asking each engine what it holds
(step 0): an engine that no longer holds what the broker loaded there is forgotten and loads it
again in step 1 of the same round. Until then the gateway finds out on its own (the engine answers
400 "never been loaded"): it retries the request on another engine, or answers UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypeGuard

from rlfleet.broker.pools import EngineRef, Pools
from rlfleet.broker.registry import Targets
from rlfleet.common.adapter_routes import ROLES, AdapterRoute, AdapterRoutes
from rlfleet.common.engine_client import EngineError, EngineRejected
from rlfleet.weights import DirectoryWeightStore, WeightStoreError

log = logging.getLogger(__name__)

ROLE_TARGET = {"canary": "canary", "fleet": "fleet"}  # route role -> Targets field


def lora_name(version: int) -> str:
    """The name an adapter version is loaded under on every engine (and requested with)."""
    return f"v{version}"


@dataclass
class AdapterRound:
    """What one round did: per engine, the adapter versions it holds; the routes now set; refusals."""

    held: dict[str, set[int]] = field(default_factory=dict)
    routes: dict[str, int] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)  # version -> why it cannot be served
    lost: dict[str, list[str]] = field(default_factory=dict)  # engine -> adapters it no longer held
    loads: int = 0
    unloads: int = 0


class AdapterSync:
    def __init__(self, store: DirectoryWeightStore, pools: Pools, routes: AdapterRoutes | None) -> None:
        self.store = store
        self.pools = pools
        self.routes = routes
        self._held: dict[str, dict[str, str]] = {}  # engine -> {lora_name: path}, from its last reply
        self.routed: dict[str, int] = {}  # role -> adapter version, as last set

    # --- what a target means ---------------------------------------------------------------------
    def is_adapter(self, version: int | None) -> TypeGuard[int]:
        """Whether `version` is a stored adapter (so, for the type checker, not None)."""
        if version is None:
            return False
        try:
            return self.store.index(version).kind == "adapter"
        except WeightStoreError:
            return False

    def base_of(self, version: int | None) -> int | None:
        """The full version an engine must serve for `version` (itself, unless it is an adapter)."""
        if not self.is_adapter(version):
            return version
        return self.store.index(version).base_version

    def wanted(self, targets: Targets) -> dict[str, int]:
        """Role -> adapter version the targets ask for (roles whose target is a full version are absent)."""
        out = {}
        for role in ROLES:
            version = getattr(targets, ROLE_TARGET[role])
            if self.is_adapter(version):
                out[role] = version
        return out

    def forget(self, engine_id: str) -> None:
        """The engine's base weights were reloaded, or it was down: it holds nothing we know of."""
        self._held.pop(engine_id, None)

    def holds(self, engine_id: str, version: int) -> bool:
        return lora_name(version) in self._held.get(engine_id, {})

    # --- one round -------------------------------------------------------------------------------
    async def reconcile(self, engines: list[EngineRef], targets: Targets) -> AdapterRound:
        """`engines`: those that serve the targets' base version now (the others catch up first)."""
        result = AdapterRound()
        wanted = self.wanted(targets)
        versions = sorted(set(wanted.values()))
        paths = await asyncio.to_thread(self._verified_paths, versions, result)
        reachable = await asyncio.gather(*(self._observe(e, result) for e in engines))
        await asyncio.gather(*(self._load(e, paths, result)
                               for e, ok in zip(engines, reachable, strict=True) if ok))
        for e in engines:
            result.held[e.engine_id] = {v for v in versions if self.holds(e.engine_id, v)}
        await self._route(wanted, engines, result)
        keep = {lora_name(v) for v in (*wanted.values(), *self.routed.values())}
        await asyncio.gather(*(self._unload(e, keep, result) for e in engines))
        return result

    async def _observe(self, engine: EngineRef, result: AdapterRound) -> bool:
        """What the engine holds now (`/v1/models`) replaces what the broker last heard: an engine that
        lost adapters the broker loaded there (restarted on the same address) is reloaded this round,
        and one holding adapters the broker never loaded (a restarted broker) has them counted as held.
        False when it cannot say (down, or unreachable): it is forgotten and loads nothing this round."""
        try:
            reported = await self.pools.client(engine).loaded_adapters()
        except EngineError as exc:
            log.warning("engine %s: cannot list its adapters (%s); loaded again once it answers",
                        engine.engine_id, exc.message)  # fmt: skip
            self.forget(engine.engine_id)
            return False
        # By name only: an engine may mount the store elsewhere and report another path for the same files.
        lost = sorted(set(self._held.get(engine.engine_id, {})) - set(reported))
        if lost:
            result.lost[engine.engine_id] = lost
            log.warning("engine %s no longer holds adapters %s that this broker loaded there (restarted?); "
                        "loading them again", engine.engine_id, ", ".join(lost))  # fmt: skip
        self._held[engine.engine_id] = reported
        return True

    def _verified_paths(self, versions: Iterable[int], result: AdapterRound) -> dict[int, str]:
        """Each adapter's store directory, every file checked against its checksums first."""
        paths = {}
        for version in versions:
            try:
                paths[version] = str(self.store.fetch_adapter(version))
            except WeightStoreError as exc:
                result.refused[version] = f"the store cannot give adapter {version} as trained: {exc}"
                log.error("adapter %d: %s", version, exc)
        return paths

    async def _load(self, engine: EngineRef, paths: dict[int, str], result: AdapterRound) -> None:
        client = self.pools.client(engine)
        for version, path in paths.items():
            name = lora_name(version)
            if name in self._held.get(engine.engine_id, {}):
                continue
            try:
                self._held[engine.engine_id] = await client.load_lora_adapter(name, path)
                result.loads += 1
                log.info("engine %s: loaded adapter %s (%s)", engine.engine_id, name, path)
            except EngineRejected as exc:
                if "already" in exc.message.lower():  # loaded before this broker knew of it
                    self._held.setdefault(engine.engine_id, {})[name] = path
                    continue
                result.refused[version] = f"engine {engine.engine_id} refused adapter {name}: {exc.message}"
                log.error("engine %s refused adapter %s: %s", engine.engine_id, name, exc.message)
            except EngineError as exc:
                log.warning("engine %s: loading adapter %s failed (%s); retried next round",
                            engine.engine_id, name, exc)  # fmt: skip
                self.forget(engine.engine_id)
                return

    async def _route(self, wanted: dict[str, int], engines: list[EngineRef], result: AdapterRound) -> None:
        """Names each role's adapter once every engine holds it; clears roles that want none."""
        changes: dict[str, AdapterRoute | None] = {}
        for role in ROLES:
            version = wanted.get(role)
            if version is None:
                if role in self.routed:
                    changes[role] = None
                continue
            everywhere = bool(engines) and all(version in result.held.get(e.engine_id, set())
                                               for e in engines)
            if everywhere and self.routed.get(role) != version:
                changes[role] = AdapterRoute(lora_name(version), version)
        if changes and self.routes is not None:
            await self.routes.set(**changes)
            log.info("adapter routes: %s", {r: (c.version if c else None) for r, c in changes.items()})
        for role, change in changes.items():
            if change is None:
                self.routed.pop(role, None)
            else:
                self.routed[role] = change.version
        result.routes = dict(self.routed)

    async def _unload(self, engine: EngineRef, keep: set[str], result: AdapterRound) -> None:
        client = self.pools.client(engine)
        for name in sorted(set(self._held.get(engine.engine_id, {})) - keep):
            try:
                self._held[engine.engine_id] = await client.unload_lora_adapter(name)
                result.unloads += 1
                log.info("engine %s: unloaded adapter %s", engine.engine_id, name)
            except EngineRejected as exc:  # not loaded there (any more): nothing to unload
                self._held.get(engine.engine_id, {}).pop(name, None)
                log.warning("engine %s: unloading adapter %s: %s", engine.engine_id, name, exc.message)
            except EngineError as exc:
                log.warning("engine %s: unloading adapter %s failed (%s); retried next round",
                            engine.engine_id, name, exc)  # fmt: skip
                return

    async def load_routes(self) -> None:
        """After a restart: the routes the gateway reads now are what this broker set before."""
        if self.routes is not None:
            self.routed = {role: r.version for role, r in (await self.routes.all()).items()}
