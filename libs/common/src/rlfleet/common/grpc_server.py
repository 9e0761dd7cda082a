"""The asyncio gRPC server skeleton and client channels every service uses.

Servers get: raised message limits, the standard `grpc.health.v1` service, reflection, OpenTelemetry
tracing, and one interceptor that turns domain errors (`rlfleet.common.errors`) into statuses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rlfleet.common.config import GrpcServerConfig
from rlfleet.common.errors import StartupError, status_for

log = logging.getLogger(__name__)


def message_options(max_bytes: int) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_bytes), ("grpc.max_receive_message_length", max_bytes)]


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps expected errors to their status; logs anything else once, as INTERNAL."""

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary
        method = details.method

        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await inner(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                mapped = status_for(exc)
                if mapped is None:
                    log.exception("unexpected error in %s", method)
                    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {exc!r}")
                code, message = mapped
                await context.abort(code, message)

        return grpc.unary_unary_rpc_method_handler(
            guarded, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


class GrpcServer:
    """An aio server with health and reflection; `start()` returns the bound port."""

    def __init__(self, config: GrpcServerConfig) -> None:
        from opentelemetry.instrumentation.grpc import aio_server_interceptor

        from rlfleet.common.telemetry import tracing_enabled

        self.config = config
        tracing = [aio_server_interceptor()] if tracing_enabled() else []
        self.server = grpc.aio.server(
            interceptors=[*tracing, ErrorInterceptor()],
            # Without SO_REUSEPORT off, a second server on a taken port "binds" and splits traffic.
            # A bounded connection age makes clients re-resolve, so new replicas get traffic.
            options=[*message_options(config.max_message_bytes), ("grpc.so_reuseport", 0),
                     ("grpc.max_connection_age_ms", 300_000), ("grpc.max_connection_age_grace_ms", 30_000)])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names: list[str] = []
        self.port = 0

    def add(self, add_fn: Callable[[Any, grpc.aio.Server], None], servicer: Any, service_name: str) -> None:
        add_fn(servicer, self.server)
        self.service_names.append(service_name)

    async def start(self) -> int:
        names = [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)
        address = f"{self.config.host}:{self.config.port}"
        try:
            self.port = self.server.add_insecure_port(address)
        except RuntimeError as exc:
            raise StartupError(f"cannot bind gRPC on {address}: {exc} (port in use?)") from None
        if self.port == 0:
            raise StartupError(f"cannot bind gRPC on {address} (port in use?)")
        await self.server.start()
        for name in [*self.service_names, ""]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self.port

    async def stop(self) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.config.grace_seconds)


def channel(address: str, max_message_bytes: int = 64 << 20, interceptors: Iterable[Any] = (),
            balance: bool = True) -> grpc.aio.Channel:
    """A client channel with raised limits, retries, keepalive and trace propagation (when tracing is on).

    `balance` spreads calls round-robin over every address a name resolves to
    (`dns:///session-server:50051`), so scaled replicas share the load; turn it off for a peer whose
    state lives on one replica (a sandbox exists only on the manager that created it)."""
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    from rlfleet.common.telemetry import tracing_enabled

    options = [*message_options(max_message_bytes), ("grpc.enable_retries", 1), ("grpc.keepalive_time_ms", 30_000)]
    if balance:
        options.append(("grpc.lb_policy_name", "round_robin"))
    tracing = aio_client_interceptors() if tracing_enabled() else []
    return grpc.aio.insecure_channel(address, options=options, interceptors=[*tracing, *interceptors] or None)


async def check_health(address: str, service: str = "", timeout_s: float = 2.0) -> bool:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
