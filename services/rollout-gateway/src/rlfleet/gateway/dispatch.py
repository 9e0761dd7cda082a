"""One generate call: route it, forward it to the engine, and retry once elsewhere if the engine fails.

A failure is reported, never hidden: the engine is marked UNHEALTHY with the error, the reply says
`rerouted=true` with the reason, and the reroute is counted. An engine that rejects the request
(4xx) is not failing; its message goes back to the caller as INVALID_ARGUMENT.

LoRA: when the broker gave the request's role an adapter (rlfleet.common.adapter_routes), the
request is sent with `lora_path` = that adapter, to any engine, and its reply's versions are the
adapter's policy version. An engine that answers it does not hold the adapter (SGLang's 400 "never
been loaded": restarted since the broker loaded it, which the broker repairs within a round) is
healthy for everything else, so it is not marked UNHEALTHY: the turn is retried once on another
engine, and if that cannot serve it either the caller gets UNAVAILABLE (retry later), never the
INVALID_ARGUMENT that would count against the episode.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from rlfleet.api.gateway.v1 import gateway_pb2
from rlfleet.common.adapter_routes import AdapterRoute, AdapterRoutes
from rlfleet.common.engine_client import (
    EngineRejected,
    EngineUnavailable,
    GenerateResult,
    VersionRange,
    adapter_missing,
)
from rlfleet.gateway.engine_io import generate_response, sampling_params, validate_input_ids
from rlfleet.gateway.errors import AdapterNotLoaded, EngineRejectedRequest, NoEngineAvailable
from rlfleet.gateway.health import parse_version
from rlfleet.gateway.metrics import GatewayMetrics
from rlfleet.gateway.registry import EngineRecord, EngineRegistry
from rlfleet.gateway.router import UNREAD, Route, Router

log = logging.getLogger(__name__)


class Dispatcher:
    def __init__(self, registry: EngineRegistry, router: Router, metrics: GatewayMetrics,
                 adapters: AdapterRoutes | None = None, on_version=None) -> None:
        self.on_version = on_version  # awaited when a reply shows an engine at a new version
        self.registry = registry
        self.router = router
        self.metrics = metrics
        self.adapters = adapters  # None: no LoRA routing (every request on the base model)
        self._labels: dict[str, dict[str, str]] = {}  # engine_id -> its metric attributes, built once

    def _engine_labels(self, engine_id: str) -> dict[str, str]:
        labels = self._labels.get(engine_id)
        if labels is None:
            if len(self._labels) > 1024:  # engines come and go: never let this grow without bound
                self._labels.clear()
            labels = self._labels[engine_id] = {"engine_id": engine_id}
        return labels

    async def generate(self, request: gateway_pb2.GenerateRequest) -> gateway_pb2.GenerateResponse:
        params = sampling_params(request.sampling)
        input_ids = list(request.input_ids)  # one copy out of the proto, checked and sent as is
        validate_input_ids(input_ids)
        adapter, affinity = await self._adapter_and_affinity(request)
        any_pool = adapter is not None
        route = await self.router.route(request.session_id, request.engine_pool, any_pool=any_pool,
                                        affinity=affinity)
        if route.rerouted:
            self._count_reroute(route, "unhealthy")
        try:
            result, latency = await self._forward(route.engine, input_ids, params, request, adapter)
        except (EngineUnavailable, AdapterNotLoaded) as first:
            if isinstance(first, EngineUnavailable):
                await self._engine_failed(route.engine, first)
                reason, cause = f"engine {route.engine.engine_id} failed: {first.message}", "failed"
            else:
                reason, cause = first.message, "adapter_missing"
            try:
                route = await self.router.reroute(request.session_id, route.engine, reason,
                                                  request.engine_pool, any_pool=any_pool)
            except NoEngineAvailable as none:
                raise NoEngineAvailable(f"{reason}; {none.message}",
                                        tried=(route.engine.engine_id,)) from None
            self._count_reroute(route, cause)
            try:
                result, latency = await self._forward(route.engine, input_ids, params, request, adapter)
            except EngineUnavailable as second:
                await self._engine_failed(route.engine, second)
                raise NoEngineAvailable(
                    f"{reason}; the retry on engine {route.engine.engine_id} failed too: {second.message}",
                    tried=(route.engine.engine_id,)) from None
        await self.router.touch(request.session_id, route.engine.engine_id)
        if adapter is None:
            # The engine's version is its base model's; a new one changes what admission counts.
            if self._observe(route.engine, result) and self.on_version is not None:
                await self.on_version()
        else:
            result = served_by_adapter(result, adapter)
        return generate_response(result, route.engine.engine_id, latency, route.rerouted, route.reason)

    async def _adapter_and_affinity(
            self, request: gateway_pb2.GenerateRequest) -> tuple[AdapterRoute | None, object]:
        """The request's adapter and its session's affinity, read in one Redis round trip. The routes
        are read per request, never cached: after a promotion or rollback no new request may still
        name the adapter the broker is about to unload."""
        role = self.router.role(request.engine_pool)
        if self.adapters is None or not request.session_id:
            return await self.adapter_for(role), UNREAD
        async with self.router.redis.pipeline(transaction=False) as pipe:
            self.adapters.queue_all(pipe)
            self.router.queue_affinity(pipe, request.session_id)
            raw_routes, affinity = await pipe.execute()
        return _for_role(self.adapters.parse(raw_routes), role), affinity

    async def adapter_for(self, role: str) -> AdapterRoute | None:
        """The role's adapter; the canary role without a candidate of its own gets the accepted one
        (so a rollback is just clearing `canary`)."""
        if self.adapters is None:
            return None
        return _for_role(await self.adapters.all(), role)

    async def _forward(self, engine: EngineRecord, input_ids: list[int], params: dict,
                       request: gateway_pb2.GenerateRequest,
                       adapter: AdapterRoute | None) -> tuple[GenerateResult, float]:
        client = self.registry.client(engine)
        self.registry.begin_request(engine.engine_id)
        started = time.monotonic()
        try:
            result = await client.generate(input_ids, params, return_logprob=request.return_logprob,
                                           rid=request.request_id or None,
                                           lora_path=None if adapter is None else adapter.lora_name)
        except EngineRejected as exc:
            if adapter is not None and adapter_missing(exc):
                log.warning("engine does not hold the routed adapter", extra={
                    "engine_id": engine.engine_id, "lora_name": adapter.lora_name, "error": exc.message})
                raise AdapterNotLoaded(
                    f"engine {engine.engine_id} does not hold adapter {adapter.lora_name} (policy version "
                    f"{adapter.version}; restarted since the weight broker loaded it?): retry, the broker "
                    f"loads it again within a round ({exc.message.splitlines()[0]})",
                    engine_id=engine.engine_id) from None
            raise EngineRejectedRequest(f"engine {engine.engine_id} rejected the request: {exc.message}",
                                        engine_id=engine.engine_id, status=exc.status) from None
        finally:
            self.registry.end_request(engine.engine_id)
        latency = time.monotonic() - started
        self.metrics.generate_seconds.record(latency, self._engine_labels(engine.engine_id))
        return result, latency

    async def _engine_failed(self, engine: EngineRecord, exc: EngineUnavailable) -> None:
        log.warning("engine failed a generate call",
                    extra={"engine_id": engine.engine_id, "error": exc.message})
        self.metrics.engine_failures.add(1, {"engine_id": engine.engine_id})
        await self.registry.mark_unhealthy(engine.engine_id, exc.message)

    def _count_reroute(self, route: Route, cause: str) -> None:
        log.info("session rerouted", extra={"engine_id": route.engine.engine_id, "reason": route.reason})
        self.metrics.reroutes.add(1, {"cause": cause})

    def _observe(self, engine: EngineRecord, result: GenerateResult) -> bool:
        """Records the reply; whether it showed the engine at another version than known."""
        self.metrics.generated_tokens.add(len(result.output_ids), self._engine_labels(engine.engine_id))
        # The reply carries the engine's version: fresher than the last probe, for staleness checks.
        version = parse_version(result.weight_version)
        if version >= 0 and version != engine.policy_version:
            engine.policy_version = version
            return True
        return False


def _for_role(routes: dict[str, AdapterRoute], role: str) -> AdapterRoute | None:
    return routes.get(role) or (routes.get("fleet") if role == "canary" else None)


def served_by_adapter(result: GenerateResult, adapter: AdapterRoute) -> GenerateResult:
    """The reply with the adapter's policy version on every token: a request keeps its adapter from
    start to end (SGLang and the CPU engine both hold it until the request finishes), and SGLang's
    own `weight_version` names the base model, not the adapter."""
    version = str(adapter.version)
    ranges = [VersionRange(version, r.start, r.end) for r in result.weight_versions] or [
        VersionRange(version, 0, len(result.output_ids))]
    return dataclasses.replace(result, weight_version=version, weight_versions=ranges)
