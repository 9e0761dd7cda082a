"""The server skeleton: health, reflection, raised message limits, errors mapped to statuses."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from rlfleet.api.session.v1 import session_pb2, session_pb2_grpc
from rlfleet.common import security
from rlfleet.common.config import GrpcServerConfig
from rlfleet.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    StartupError,
)
from rlfleet.common.grpc_server import GrpcServer, blocking_channel, channel
from rlfleet.common.rich_errors import error_details
from rlfleet.common.service import placeholder_servicer
from rlfleet.common.testing import client_credentials

SERVICE = "rlfleet.session.v1.SessionService"


class Sessions(session_pb2_grpc.SessionServiceServicer):
    async def GetSession(self, request, context):
        errors = {"bad": InvalidArgument("session_id 'bad' is malformed"),
                  "fielded": InvalidArgument("prompt is empty", field="prompt", session_id="fielded",
                                             state=None),
                  "full": ResourceExhausted("no slot for 'full'", retry_after_s=2.5, reason="capacity"),
                  "gone": SandboxGone("sandbox 'gone' expired", sandbox_id="gone"),
                  "missing": NotFound("no session 'missing'"),
                  "closed": FailedPrecondition("session 'closed' is closed"),
                  "busy": ResourceExhausted("too many sessions (busy)"),
                  "boom": RuntimeError("unexpected"),
                  "huge-boom": RuntimeError("x" * (4 << 20))}
        if request.session_id in errors:
            raise errors[request.session_id]
        if request.session_id == "caller":  # who the server took the caller for
            principal = security.caller()
            return session_pb2.Session(session_id=f"{principal.kind}:{principal.name}")
        return session_pb2.Session(session_id=request.session_id,
                                   token_ids=list(range(len(request.session_id))))

    async def OpenSession(self, request, context):
        # echoes the prompt back: used to send a large message both ways
        return session_pb2.OpenSessionResponse(prompt_token_ids=request.prompt_token_ids.ids)


class SandboxGone(NotFound):
    """A domain error declared outside libs/common, as a service declares its own."""


@pytest.fixture
async def server():
    srv = GrpcServer(GrpcServerConfig(port=0, max_message_bytes=32 << 20))
    srv.add(session_pb2_grpc.add_SessionServiceServicer_to_server, Sessions(), SERVICE)
    port = await srv.start()
    yield f"127.0.0.1:{port}"
    await srv.stop()


async def test_domain_errors_become_their_status_codes_with_the_message(server):
    async with channel(server) as ch:
        stub = session_pb2_grpc.SessionServiceStub(ch)
        for session_id, code in [("bad", grpc.StatusCode.INVALID_ARGUMENT),
                                 ("missing", grpc.StatusCode.NOT_FOUND),
                                 ("closed", grpc.StatusCode.FAILED_PRECONDITION),
                                 ("busy", grpc.StatusCode.RESOURCE_EXHAUSTED),
                                 ("boom", grpc.StatusCode.INTERNAL)]:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.GetSession(session_pb2.GetSessionRequest(session_id=session_id))
            assert info.value.code() == code
            assert session_id in info.value.details() or code == grpc.StatusCode.INTERNAL
        reply = await stub.GetSession(session_pb2.GetSessionRequest(session_id="ok"))
        assert reply.session_id == "ok"


async def get(server: str, session_id: str) -> grpc.aio.AioRpcError:
    async with channel(server) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            stub = session_pb2_grpc.SessionServiceStub(ch)
            await stub.GetSession(session_pb2.GetSessionRequest(session_id=session_id))
    return info.value


async def test_an_error_s_structured_fields_reach_the_client_in_the_rich_status(server):
    bad = error_details(await get(server, "fielded"))
    assert (bad.code, bad.message) == (grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")
    assert (bad.reason, bad.domain) == ("INVALID_ARGUMENT", "rlfleet.common")
    assert bad.field == "prompt" and bad.field_violations == {"prompt": "prompt is empty"}
    assert bad.metadata == {"field": "prompt", "session_id": "fielded"}  # None-valued fields are left out
    assert bad.retry_after_s is None
    full = error_details(await get(server, "full"))
    assert full.retry_after_s == pytest.approx(2.5) and full.metadata["reason"] == "capacity"
    assert full.reason == "RESOURCE_EXHAUSTED" and full.field is None
    gone = error_details(await get(server, "gone"))
    assert (gone.code, gone.reason) == (grpc.StatusCode.NOT_FOUND, "SANDBOX_GONE")
    assert gone.metadata == {"sandbox_id": "gone"}


async def test_an_unexpected_error_is_internal_and_carries_no_details(server):
    boom = error_details(await get(server, "boom"))
    assert boom.code == grpc.StatusCode.INTERNAL and "RuntimeError('unexpected')" in boom.message
    assert (boom.reason, boom.metadata, boom.field_violations) == ("", {}, {})


async def test_an_unexpected_error_never_echoes_a_large_message_whole(server):
    # A 4 MB message in the status would itself be refused (RESOURCE_EXHAUSTED) and hide the error.
    boom = error_details(await get(server, "huge-boom"))
    assert boom.code == grpc.StatusCode.INTERNAL and "characters in all" in boom.message
    assert len(boom.message) < 1000


async def test_a_blocking_channel_calls_as_the_client_its_token_names(server):
    """The token rides in each call's metadata (not as call credentials: closing a channel that
    holds a call-credentials plugin can deadlock the process, grpc/grpc#42247)."""
    creds = client_credentials("blocking-run", "env-blocking")

    def calls() -> list[str]:
        names = []
        for _ in range(3):  # a channel per call, as scripts and test harnesses poll
            with blocking_channel(server, credentials=creds) as ch:
                stub = session_pb2_grpc.SessionServiceStub(ch)
                names.append(stub.GetSession(session_pb2.GetSessionRequest(session_id="caller"),
                                             timeout=10).session_id)
        with blocking_channel(server, credentials=creds) as ch:
            with pytest.raises(grpc.RpcError) as refused:  # a call's own header wins over the channel's
                session_pb2_grpc.SessionServiceStub(ch).GetSession(
                    session_pb2.GetSessionRequest(session_id="caller"), timeout=10,
                    metadata=(("authorization", "Bearer not-a-token"),))
        names.append(refused.value.code().name)
        return names

    assert await asyncio.to_thread(calls) == ["environment:env-blocking"] * 3 + ["UNAUTHENTICATED"]


async def test_health_reports_serving_for_the_server_and_each_service(server):
    async with channel(server) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", SERVICE):
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=name))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_reflection_lists_the_services(server):
    async with channel(server) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)

        async def requests():
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        async for reply in stub.ServerReflectionInfo(requests()):
            names = {s.name for s in reply.list_services_response.service}
            break
    assert {SERVICE, "grpc.health.v1.Health"} <= names


async def test_messages_above_the_4mb_default_pass_both_ways(server):
    ids = list(range(2_000_000))  # ~ 8+ MB packed varints
    async with channel(server, max_message_bytes=32 << 20) as ch:
        stub = session_pb2_grpc.SessionServiceStub(ch)
        reply = await stub.OpenSession(session_pb2.OpenSessionRequest(
            prompt_token_ids={"ids": ids}))
    assert len(reply.prompt_token_ids) == len(ids)


async def test_placeholder_rpcs_answer_unimplemented_and_name_the_issue():
    srv = GrpcServer(GrpcServerConfig(port=0))
    servicer = placeholder_servicer(session_pb2_grpc.SessionServiceServicer, SERVICE, "issue #3")
    srv.add(session_pb2_grpc.add_SessionServiceServicer_to_server, servicer, SERVICE)
    port = await srv.start()
    try:
        async with channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await session_pb2_grpc.SessionServiceStub(ch).Generate(
                    session_pb2.GenerateRequest(session_id="s"))
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "Generate is not implemented yet (issue #3)" in info.value.details()
    finally:
        await srv.stop()


async def test_a_port_in_use_is_a_startup_error_not_a_traceback(server):
    port = int(server.rsplit(":", 1)[1])
    srv = GrpcServer(GrpcServerConfig(port=port))
    try:
        with pytest.raises(StartupError, match="cannot bind gRPC"):
            await srv.start()
    finally:
        await srv.server.stop(0)


async def test_a_client_finds_a_restarted_peer_within_seconds_after_a_long_outage():
    """gRPC's own reconnect backoff grows to 120 s (1 s x 1.6 per try): a client that failed through
    a 10 s outage would wait another ~6 s after the peer is back. The channel's bound is 2 s."""
    import asyncio
    import time

    async def serve(port: int) -> GrpcServer:
        srv = GrpcServer(GrpcServerConfig(port=port))
        srv.add(session_pb2_grpc.add_SessionServiceServicer_to_server, Sessions(), SERVICE)
        await srv.start()
        return srv

    first = await serve(0)
    port = first.port
    async with channel(f"127.0.0.1:{port}") as ch:
        stub = session_pb2_grpc.SessionServiceStub(ch)
        await stub.GetSession(session_pb2.GetSessionRequest(session_id="ok"), timeout=5)
        await first.stop()
        outage_until = time.monotonic() + 10
        while time.monotonic() < outage_until:  # every call fails fast, and the backoff grows
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.GetSession(session_pb2.GetSessionRequest(session_id="ok"), timeout=1)
            assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            await asyncio.sleep(0.1)
        second = await serve(port)
        back = time.monotonic()
        try:
            while True:
                try:
                    await stub.GetSession(session_pb2.GetSessionRequest(session_id="ok"), timeout=1)
                    break
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                    assert time.monotonic() - back < 10, "the client did not find the restarted peer"
                    await asyncio.sleep(0.05)
            found_after = time.monotonic() - back
        finally:
            await second.stop()
    assert found_after < 3.5, f"the client found its restarted peer only after {found_after:.1f} s"
