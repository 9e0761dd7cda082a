"""The session server's side of the gateway: generate, admit, release, with errors in session terms.

Each call is traced as the OpenTelemetry gRPC client instrumentation would (a CLIENT span named after
the method, with the same attributes, and the trace context in the call's metadata), but without a
grpc.aio client interceptor: an intercepted call takes a much slower path through grpc.aio, which
cost the session server a few hundred microseconds of CPU per call, several times per turn.
"""

from __future__ import annotations

import grpc
from opentelemetry import propagate, trace
from opentelemetry.instrumentation.utils import is_instrumentation_enabled
from opentelemetry.trace.status import Status, StatusCode

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from rlfleet.common.grpc_server import message_options
from rlfleet.common.telemetry import tracing_enabled
from rlfleet.session.errors import GatewayRejected, GatewayUnavailable, SessionsExhausted

_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name
# The scope the gRPC client instrumentation reports its spans under, so these look the same downstream.
_tracer = trace.get_tracer("opentelemetry.instrumentation.grpc._client")


def _channel(address: str, max_message_bytes: int = 64 << 20) -> grpc.aio.Channel:
    """`rlfleet.common.grpc_server.channel`'s options (limits, retries, keepalive, round robin), no interceptors."""
    options = [*message_options(max_message_bytes), ("grpc.enable_retries", 1), ("grpc.keepalive_time_ms", 30_000),
               ("grpc.lb_policy_name", "round_robin")]
    return grpc.aio.insecure_channel(address, options=options)


class _Method:
    """One traced unary method of the gateway stub."""

    def __init__(self, stub: gateway_pb2_grpc.GatewayServiceStub, name: str) -> None:
        self.call = getattr(stub, name)
        self.traced = tracing_enabled()
        self.span_name = f"/{_SERVICE}/{name}"
        # Built once: the attributes the instrumentation sets on a client span.
        self.attributes = {"rpc.system": "grpc", "rpc.grpc.status_code": grpc.StatusCode.OK.value[0],
                           "rpc.method": name, "rpc.service": _SERVICE}

    async def __call__(self, request, timeout_s: float):
        if not self.traced or not is_instrumentation_enabled():
            return await self.call(request, timeout=timeout_s)
        with _tracer.start_as_current_span(self.span_name, kind=trace.SpanKind.CLIENT, attributes=self.attributes,
                                           record_exception=False, set_status_on_exception=False) as span:
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            try:
                return await self.call(request, timeout=timeout_s,
                                       metadata=tuple((k.lower(), v) for k, v in carrier.items()))
            except grpc.aio.AioRpcError as exc:
                span.set_attribute("rpc.grpc.status_code", exc.code().value[0])
                span.set_status(Status(status_code=StatusCode.ERROR, description=f"{type(exc).__name__}: {exc}"))
                span.record_exception(exc)
                raise


class GatewayClient:
    def __init__(self, address: str, generate_timeout_s: float, control_timeout_s: float = 10.0) -> None:
        self.address = address
        self._channel = _channel(address)
        stub = gateway_pb2_grpc.GatewayServiceStub(self._channel)
        self._generate = _Method(stub, "Generate")
        self._admit = _Method(stub, "Admit")
        self._release = _Method(stub, "Release")
        self.generate_timeout_s = generate_timeout_s
        self.control_timeout_s = control_timeout_s

    async def close(self) -> None:
        await self._channel.close()

    async def generate(self, session_id: str, input_ids, sampling: common_pb2.SamplingParams,
                       request_id: str, engine_pool: str = "") -> gateway_pb2.GenerateResponse:
        try:
            pool = gateway_pb2.EnginePool.Value(f"ENGINE_POOL_{engine_pool.upper()}") if engine_pool else 0
        except ValueError:
            raise GatewayRejected(f"metadata engine_pool {engine_pool!r} is not a pool (fleet or canary)",
                                  session_id=session_id) from None
        request = gateway_pb2.GenerateRequest(session_id=session_id, input_ids=input_ids, sampling=sampling,
                                              return_logprob=True, request_id=request_id, engine_pool=pool)
        return await self._call(self._generate, request, self.generate_timeout_s, session_id)

    async def admit(self, session_id: str, run_id: str) -> None:
        """Raises SessionsExhausted with the gateway's reason when it refuses the session."""
        reply = await self._call(self._admit, gateway_pb2.AdmitRequest(session_id=session_id, run_id=run_id),
                                 self.control_timeout_s, session_id)
        if not reply.admitted:
            raise SessionsExhausted(
                f"the gateway refused a new session: {reply.reason} (retry after {reply.retry_after_ms} ms)",
                reason=reply.reason, retry_after_s=reply.retry_after_ms / 1000)

    async def release(self, session_id: str) -> None:
        await self._call(self._release, gateway_pb2.ReleaseRequest(session_id=session_id),
                         self.control_timeout_s, session_id)

    async def _call(self, method, request, timeout_s: float, session_id: str):
        try:
            return await method(request, timeout_s)
        except grpc.aio.AioRpcError as exc:
            details = exc.details() or exc.code().name
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise GatewayRejected(details, session_id=session_id) from None
            raise GatewayUnavailable(f"gateway at {self.address}: {exc.code().name}: {details}",
                                     session_id=session_id, code=exc.code().name) from None
