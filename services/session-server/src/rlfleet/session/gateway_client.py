"""The session server's side of the gateway: generate, admit, release, with errors in session terms."""

from __future__ import annotations

import grpc

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from rlfleet.common.grpc_server import channel
from rlfleet.session.errors import GatewayRejected, GatewayUnavailable, SessionsExhausted


class GatewayClient:
    def __init__(self, address: str, generate_timeout_s: float, control_timeout_s: float = 10.0) -> None:
        self.address = address
        self._channel = channel(address)
        self._stub = gateway_pb2_grpc.GatewayServiceStub(self._channel)
        self.generate_timeout_s = generate_timeout_s
        self.control_timeout_s = control_timeout_s

    async def close(self) -> None:
        await self._channel.close()

    async def generate(self, session_id: str, input_ids, sampling: common_pb2.SamplingParams,
                       request_id: str, engine_pool: str = "") -> gateway_pb2.GenerateResponse:
        try:
            pool = (gateway_pb2.EnginePool.Value(f"ENGINE_POOL_{engine_pool.upper()}") if engine_pool
                    else gateway_pb2.ENGINE_POOL_UNSPECIFIED)
        except ValueError:
            raise GatewayRejected(
                f"metadata engine_pool {engine_pool!r} is not a pool (fleet, canary or candidate)",
                session_id=session_id) from None
        request = gateway_pb2.GenerateRequest(session_id=session_id, input_ids=input_ids, sampling=sampling,
                                              return_logprob=True, request_id=request_id, engine_pool=pool)
        return await self._call(self._stub.Generate, request, self.generate_timeout_s, session_id)

    async def admit(self, session_id: str, run_id: str) -> None:
        """Raises SessionsExhausted with the gateway's reason when it refuses the session."""
        reply = await self._call(self._stub.Admit,
                                 gateway_pb2.AdmitRequest(session_id=session_id, run_id=run_id),
                                 self.control_timeout_s, session_id)
        if not reply.admitted:
            raise SessionsExhausted(
                f"the gateway refused a new session: {reply.reason} (retry after {reply.retry_after_ms} ms)",
                reason=reply.reason, retry_after_s=reply.retry_after_ms / 1000)

    async def release(self, session_id: str) -> None:
        await self._call(self._stub.Release, gateway_pb2.ReleaseRequest(session_id=session_id),
                         self.control_timeout_s, session_id)

    async def _call(self, method, request, timeout_s: float, session_id: str):
        try:
            return await method(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            details = exc.details() or exc.code().name
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise GatewayRejected(details, session_id=session_id) from None
            raise GatewayUnavailable(f"gateway at {self.address}: {exc.code().name}: {details}",
                                     session_id=session_id, code=exc.code().name) from None
