"""The rollout-gateway service process: engines from config, a health checker, and the RPCs."""

from __future__ import annotations

import asyncio
import contextlib

from rlfleet.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from rlfleet.common.adapter_routes import AdapterRoutes
from rlfleet.common.engine_client import EngineTimeouts
from rlfleet.common.grpc_server import GrpcServer
from rlfleet.common.peers import PeersApp
from rlfleet.gateway.admission import Admission
from rlfleet.gateway.config import EngineSpec, RolloutGatewayConfig
from rlfleet.gateway.dispatch import Dispatcher
from rlfleet.gateway.health import HealthChecker
from rlfleet.gateway.metrics import GatewayMetrics
from rlfleet.gateway.registry import EngineRecord, EngineRegistry
from rlfleet.gateway.router import Router
from rlfleet.gateway.servicer import GatewayServicer

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name
POOLS = {"fleet": gateway_pb2.ENGINE_POOL_FLEET, "canary": gateway_pb2.ENGINE_POOL_CANARY,
         "candidate": gateway_pb2.ENGINE_POOL_CANDIDATE}
KINDS = {"cpu": gateway_pb2.ENGINE_KIND_CPU, "sglang": gateway_pb2.ENGINE_KIND_SGLANG}


class RolloutGatewayApp(PeersApp):
    uses_nats = False
    uses_redis = True
    config: RolloutGatewayConfig

    async def start(self, server: GrpcServer) -> None:
        config = self.config
        await self.connect()
        redis = self.connected_redis()
        timeouts = EngineTimeouts(connect_s=config.connect_timeout_s, generate_s=config.generate_timeout_s,
                                  control_s=config.control_timeout_s)
        self.registry = EngineRegistry(redis, config.run_id, timeouts, api_key=config.engine_api_key,
                                       admin_api_key=config.engine_admin_api_key)
        for spec in config.engines:
            await self.registry.register(_record(spec))
        admission = Admission(redis, config.run_id, config.admission_lease_s, config.retry_after_ms)
        await admission.seed_policy(config.max_inflight_sessions, config.max_staleness)
        pools = frozenset(gateway_pb2.EnginePool.Value(f"ENGINE_POOL_{p.upper()}")
                          for p in config.route_pools)
        router = Router(redis, config.run_id, self.registry, config.affinity_ttl_s, pools)
        metrics = GatewayMetrics(lambda: list(self.registry.engines.values()), self.registry.busy_seconds,
                                 lambda engine_id: self.registry.local_in_flight.get(engine_id, 0))
        # What a session server needs to admit sessions itself, kept current (rlfleet.common.session_slots).
        adapters = AdapterRoutes(redis, config.run_id)

        async def advertise(again: bool = False) -> None:
            await admission.advertise(self.registry.fleet_min_version(router.route_pools),
                                      router.role(0), again)

        self.health = HealthChecker(self.registry, config.health_interval_s, config.health_generate,
                                    after_round=lambda: advertise(again=True))
        # Serve with every engine's state known, but do not let a hung engine hold up the start.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.health.check_all(), timeout=config.connect_timeout_s + 1.0)
        self.health.start()
        await advertise()
        dispatcher = Dispatcher(self.registry, router, metrics, adapters, on_version=advertise)
        servicer = GatewayServicer(config.run_id, self.registry, router, dispatcher, self.health,
                                   admission, metrics, advertise)
        server.add(gateway_pb2_grpc.add_GatewayServiceServicer_to_server, servicer, SERVICE_NAME)

    async def stop(self) -> None:
        if getattr(self, "health", None) is not None:
            await self.health.stop()
        if getattr(self, "registry", None) is not None:
            await self.registry.close()
        await super().stop()


def _record(spec: EngineSpec) -> EngineRecord:
    return EngineRecord(spec.engine_id, spec.url.rstrip("/"), POOLS[spec.pool], KINDS[spec.kind])


def build(config: RolloutGatewayConfig) -> RolloutGatewayApp:
    return RolloutGatewayApp(config, "rlfleet-gateway")
