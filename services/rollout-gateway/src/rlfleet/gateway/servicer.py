"""GatewayService: the RPCs, each a few lines over the gateway's components."""

from __future__ import annotations

import asyncio
import logging
import re

import grpc

from rlfleet.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from rlfleet.common.adapter_routes import routes_key
from rlfleet.common.engine_client import EngineError
from rlfleet.common.errors import require_known_enums
from rlfleet.gateway.admission import Admission
from rlfleet.gateway.dispatch import Dispatcher
from rlfleet.gateway.engine_io import PAUSE_MODES
from rlfleet.gateway.errors import InvalidGatewayRequest
from rlfleet.gateway.health import HealthChecker
from rlfleet.gateway.metrics import GatewayMetrics
from rlfleet.gateway.registry import EngineRecord, EngineRegistry
from rlfleet.gateway.router import Router

log = logging.getLogger(__name__)
ENGINE_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, run_id: str, registry: EngineRegistry, router: Router, dispatcher: Dispatcher,
                 health: HealthChecker, admission: Admission, metrics: GatewayMetrics,
                 advertise=None) -> None:
        self.advertise = advertise  # awaited after a change to the engines (the admission advert)
        self.run_id = run_id
        self.registry = registry
        self.router = router
        self.dispatcher = dispatcher
        self.health = health
        self.admission = admission
        self.metrics = metrics

    async def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        require_known_enums(request)
        return await self.dispatcher.generate(request)

    # --- registry -------------------------------------------------------------------------------
    async def RegisterEngine(self, request: gateway_pb2.RegisterEngineRequest, context):
        require_known_enums(request)
        record = EngineRecord(
            engine_id=_engine_id(request.engine_id), url=_url(request.url),
            pool=request.pool or gateway_pb2.ENGINE_POOL_FLEET, kind=request.kind,
            labels=dict(request.labels), draining=request.start_draining)
        record = await self.registry.register(record)
        await self.health.check(record)  # answer with its real state, not "unprobed"
        await self._advertise()
        return await self._engine_proto(record.engine_id)

    async def DeregisterEngine(self, request: gateway_pb2.DeregisterEngineRequest, context):
        await self.registry.deregister(_engine_id(request.engine_id))
        await self._advertise()
        return gateway_pb2.DeregisterEngineResponse()

    async def ListEngines(self, request: gateway_pb2.ListEnginesRequest, context):
        await self.registry.refresh()
        ids = sorted(self.registry.engines)
        counts = await self.router.session_counts(ids)
        return gateway_pb2.ListEnginesResponse(engines=[
            self.registry.engines[e].to_proto(counts[e], self.registry.local_in_flight.get(e, 0))
            for e in ids])

    async def UpdateEngineState(self, request: gateway_pb2.UpdateEngineStateRequest, context):
        """DRAINING (no new sessions) or HEALTHY (takes new sessions again); health and pause are separate."""
        require_known_enums(request)  # before EngineState.Name below, which raises on an unknown value
        if request.state not in (gateway_pb2.ENGINE_STATE_HEALTHY, gateway_pb2.ENGINE_STATE_DRAINING):
            raise InvalidGatewayRequest(
                f"state must be ENGINE_STATE_HEALTHY or ENGINE_STATE_DRAINING, got "
                f"{gateway_pb2.EngineState.Name(request.state)}", field="state")
        await self.registry.refresh()
        engine = self.registry.get(_engine_id(request.engine_id))
        fields: dict[str, object] = {"draining": request.state == gateway_pb2.ENGINE_STATE_DRAINING}
        if request.HasField("policy_version"):
            fields["policy_version"] = request.policy_version
        await self.registry.update(engine.engine_id, **fields)
        await self._advertise()
        log.info("engine state updated", extra={"engine_id": engine.engine_id, "draining": fields["draining"],
                                                "reason": request.reason})
        return await self._engine_proto(engine.engine_id)

    # --- pause / resume -------------------------------------------------------------------------
    async def PauseEngines(self, request: gateway_pb2.PauseEnginesRequest, context):
        require_known_enums(request)
        mode = PAUSE_MODES.get(request.mode)
        if mode is None:
            raise InvalidGatewayRequest(f"unknown pause mode {request.mode}", field="mode")

        async def pause(engine: EngineRecord) -> None:
            await self.registry.client(engine).pause(mode)
            await self.registry.update(engine.engine_id, paused=mode)

        return gateway_pb2.PauseEnginesResponse(results=await self._each(request.engine_ids, pause))

    async def ResumeEngines(self, request: gateway_pb2.ResumeEnginesRequest, context):
        async def resume(engine: EngineRecord) -> None:
            await self.registry.client(engine).resume()
            await self.registry.update(engine.engine_id, paused="")

        return gateway_pb2.ResumeEnginesResponse(results=await self._each(request.engine_ids, resume))

    # --- admission ------------------------------------------------------------------------------
    async def Admit(self, request: gateway_pb2.AdmitRequest, context):
        if request.run_id and request.run_id != self.run_id:
            raise InvalidGatewayRequest(f"this gateway serves run {self.run_id!r}, not {request.run_id!r}",
                                        field="run_id")
        # The adapter's version is read by the admission script itself: one Redis round trip.
        adapters = self.dispatcher.adapters
        decision = await self.admission.admit(
            request.session_id, self.registry.fleet_min_version(self.router.route_pools),
            None if adapters is None else (routes_key(self.run_id), self.router.role(0)))
        self.metrics.admissions.add(1, {"outcome": "admitted" if decision.admitted else decision.reason})
        return gateway_pb2.AdmitResponse(admitted=decision.admitted, reason=decision.reason,
                                         retry_after_ms=decision.retry_after_ms)

    async def Release(self, request: gateway_pb2.ReleaseRequest, context):
        if not request.session_id:
            raise InvalidGatewayRequest("session_id is required", field="session_id")
        # The admission slot goes in the router's forget: one Redis round trip for both.
        await self.router.forget(request.session_id, release_from=self.admission.inflight_key)
        return gateway_pb2.ReleaseResponse()

    async def SetAdmissionPolicy(self, request: gateway_pb2.AdmissionPolicy, context):
        await self.admission.set_policy(request)
        return await self.admission.status(await self._fleet_version())

    async def GetAdmissionStatus(self, request: gateway_pb2.GetAdmissionStatusRequest, context):
        return await self.admission.status(await self._fleet_version())

    # --- helpers --------------------------------------------------------------------------------
    async def _advertise(self) -> None:
        if self.advertise is not None:
            await self.advertise()

    async def _fleet_version(self) -> int | None:
        """The policy version new sessions are served: the adapter's when the broker routes their role
        to one (the engines' own version is then the base model's), else the oldest engine's."""
        adapter = await self.dispatcher.adapter_for(self.router.role(0))
        if adapter is not None:
            return adapter.version
        return self.registry.fleet_min_version(self.router.route_pools)

    async def _engine_proto(self, engine_id: str) -> gateway_pb2.Engine:
        counts = await self.router.session_counts([engine_id])
        return self.registry.get(engine_id).to_proto(counts[engine_id])

    async def _each(self, engine_ids, action) -> list[gateway_pb2.EngineResult]:
        """Runs `action` on the named engines (all when none is named), one result per engine."""
        await self.registry.refresh()
        engines, unknown = self.registry.select(list(engine_ids))

        async def one(engine: EngineRecord) -> gateway_pb2.EngineResult:
            try:
                await action(engine)
            except EngineError as exc:
                return gateway_pb2.EngineResult(engine_id=engine.engine_id, ok=False, message=exc.message)
            return gateway_pb2.EngineResult(engine_id=engine.engine_id, ok=True)

        results = list(await asyncio.gather(*(one(e) for e in engines)))
        results += [gateway_pb2.EngineResult(engine_id=e, ok=False, message=f"engine {e!r} is not registered")
                    for e in unknown]
        return results


def _engine_id(engine_id: str) -> str:
    if not ENGINE_ID.match(engine_id):
        raise InvalidGatewayRequest(
            f"engine_id must be 1-128 characters of letters, digits and _.:-, got {engine_id!r}",
            field="engine_id")
    return engine_id


def _url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise InvalidGatewayRequest(f"url must be an http(s) base URL, got {url!r}", field="url")
    return url.rstrip("/")
