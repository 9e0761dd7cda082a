"""The asyncio gRPC server skeleton and client channels every service uses.

Servers get: TLS with the run's certificates (mutual TLS where no environment client calls), raised
message limits, the standard `grpc.health.v1` service, reflection, OpenTelemetry tracing (when it is
on), and one interceptor that authenticates and authorizes each call (`rlfleet.common.roles`, deny by
default) and turns domain errors (`rlfleet.common.errors`) into statuses with their structured fields
(gRPC's rich-error model, `rlfleet.common.rich_errors`).
Client channels are TLS, present this process's certificate and token (`rlfleet.common.security`),
and trace their calls without an interceptor (`TracedChannel`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, Self

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rlfleet.common import roles, security
from rlfleet.common.config import GrpcServerConfig
from rlfleet.common.errors import InvalidArgument, RlfleetError, StartupError, Unauthenticated, clip
from rlfleet.common.rich_errors import rich_status
from rlfleet.common.telemetry import tracing_enabled

log = logging.getLogger(__name__)
BENCHMARK_CALLER = security.Principal(security.OPERATOR, "plaintext-benchmark")


def message_options(max_bytes: int) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_bytes), ("grpc.max_receive_message_length", max_bytes)]


def authenticate(context: grpc.aio.ServicerContext, book: security.TokenBook | None,
                 ) -> tuple[security.Principal | None, str]:
    """The caller and its bearer token: a token in the `authorization` header, else the run
    certificate the caller presented (mutual TLS); (None, "") for neither."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            scheme, _, token = value.partition(" ")
            if scheme.lower() != "bearer" or not token or book is None:
                raise Unauthenticated("the authorization header must be `Bearer <token>`",
                                      right="authenticated")
            return book.verify(token.strip()), token.strip()
    names = context.auth_context().get("x509_common_name")
    if names:
        name = names[0].decode()
        return security.Principal(security.OPERATOR if name == "operator" else security.SERVICE, name), ""
    return None, ""


async def _refuse(context: grpc.aio.ServicerContext, exc: RlfleetError) -> None:
    status = rich_status(exc)
    await context.abort(status.code, status.details, status.trailing_metadata)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates and authorizes each call (`roles.authorize`; the caller is `security.caller()`
    inside the handler); maps expected errors to their status with their structured details; logs
    anything else once, as INTERNAL."""

    def __init__(self, book: security.TokenBook | None = None, open_to_all: bool = False) -> None:
        self.book = book
        self.open_to_all = open_to_all  # the benchmarks' plaintext mode only (security.plaintext)

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return handler
        if handler.unary_unary is None:
            return self._guarded_stream(handler, details.method)
        inner = handler.unary_unary
        method = details.method
        deserialize = handler.request_deserializer
        book = self.book
        open_to_all = self.open_to_all

        async def guarded(raw: Any, context: grpc.aio.ServicerContext) -> Any:
            principal: security.Principal | None = BENCHMARK_CALLER
            token = ""
            try:
                if not open_to_all:
                    principal, token = authenticate(context, book)
                    roles.authorize(method, principal)
            except (security.Unauthenticated, roles.PermissionDenied) as exc:
                await _refuse(context, exc)
            security.set_caller(principal)
            security._forwarded.set(token)
            # Deserialized here rather than by grpc, so that bytes that are no valid request (a
            # string field with bad UTF-8, a truncated message) are the client's INVALID_ARGUMENT,
            # not an opaque failure of the server.
            try:
                request = deserialize(raw) if deserialize is not None else raw
            except DecodeError as exc:
                status = rich_status(InvalidArgument(f"{method}: the request does not parse: {exc}",
                                                     field="request"))
                await context.abort(status.code, status.details, status.trailing_metadata)
            try:
                return await inner(request, context)
            except grpc.aio.AbortError:
                raise
            except RlfleetError as exc:
                # The structured fields go too, as a google.rpc.Status in the trailer (rich_errors.py).
                await _refuse(context, exc)
            except Exception as exc:
                log.exception("unexpected error in %s", method)
                await context.abort(grpc.StatusCode.INTERNAL, clip(f"internal error in {method}: {exc!r}"))

        return grpc.unary_unary_rpc_method_handler(
            guarded, request_deserializer=None,
            response_serializer=handler.response_serializer)

    def _guarded_stream(self, handler: Any, method: str) -> Any:
        """Streaming methods (reflection, health's Watch) get the same check before they run."""
        book = self.book
        if self.open_to_all:
            return handler

        async def check(context: grpc.aio.ServicerContext) -> None:
            try:
                principal, _token = authenticate(context, book)
                roles.authorize(method, principal)
            except (security.Unauthenticated, roles.PermissionDenied) as exc:
                await _refuse(context, exc)

        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await check(context)
                async for item in _as_async_iter(inner_us(request, context)):
                    yield item

            return grpc.unary_stream_rpc_method_handler(unary_stream, handler.request_deserializer,
                                                        handler.response_serializer)
        if handler.stream_stream is not None:
            inner_ss = handler.stream_stream

            async def stream_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                await check(context)
                async for item in _as_async_iter(inner_ss(requests, context)):
                    yield item

            return grpc.stream_stream_rpc_method_handler(stream_stream, handler.request_deserializer,
                                                         handler.response_serializer)
        inner_su = handler.stream_unary

        async def stream_unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            await check(context)
            return await inner_su(requests, context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, handler.request_deserializer,
                                                    handler.response_serializer)


async def _as_async_iter(result: Any):
    """A streaming handler's output: an async generator, or a coroutine that writes to the context."""
    if hasattr(result, "__aiter__"):
        async for item in result:
            yield item
    else:
        value = await result
        if value is not None:
            yield value


def tls_server_credentials(require_client_auth: bool = False,
                           credentials: security.Credentials | None = None) -> grpc.ServerCredentials:
    """This process's certificate as a server's (a server not built here: a test's stand-in)."""
    creds = credentials or security.local_credentials()
    return grpc.ssl_server_credentials([(creds.key, creds.cert)], root_certificates=creds.ca,
                                       require_client_auth=require_client_auth)


class GrpcServer:
    """An aio server with health and reflection; `start()` returns the bound port."""

    def __init__(self, config: GrpcServerConfig) -> None:
        from opentelemetry.instrumentation.grpc import aio_server_interceptor

        self.config = config
        self.plaintext = security.plaintext()
        if self.plaintext:
            log.warning("%s=1: serving gRPC in PLAINTEXT with NO authentication (benchmarks only)",
                        security.PLAINTEXT_ENV)
        self.credentials = None if self.plaintext else security.local_credentials()
        if self.credentials is not None and self.credentials.book is None:
            raise StartupError("a gRPC server needs the run's secrets directory (RLFLEET_SECRETS_DIR; "
                               "`rlfleet up` makes it), not just a client token")
        tracing = [aio_server_interceptor()] if tracing_enabled() else []
        book = None if self.credentials is None else self.credentials.book
        self.server = grpc.aio.server(
            interceptors=[*tracing, ErrorInterceptor(book, open_to_all=self.plaintext)],
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
            self.port = (self.server.add_insecure_port(address) if self.plaintext
                         else self.server.add_secure_port(address, self.server_credentials()))
        except RuntimeError as exc:
            raise StartupError(f"cannot bind gRPC on {address}: {exc} (port in use?)") from None
        if self.port == 0:
            raise StartupError(f"cannot bind gRPC on {address} (port in use?)")
        await self.server.start()
        for name in [*self.service_names, ""]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self.port

    @property
    def mutual_tls(self) -> bool:
        """Client certificates are demanded unless an environment client (token only) calls here."""
        return not any(roles.open_to_environment(name) for name in self.service_names)

    def server_credentials(self) -> grpc.ServerCredentials:
        return tls_server_credentials(self.mutual_tls, self.credentials)

    async def stop(self) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.config.grace_seconds)


# gRPC's default reconnect backoff grows to 120 s: a peer that restarted in two seconds would stay
# unreachable to its clients for up to two minutes. Bounded to a few seconds, calls find it again
# about as soon as it serves.
RECONNECT_BACKOFF = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                     ("grpc.max_reconnect_backoff_ms", 2_000)]


def channel_credentials(creds: security.Credentials) -> grpc.ChannelCredentials:
    if creds.cert:
        return grpc.ssl_channel_credentials(creds.ca, creds.key, creds.cert)
    return grpc.ssl_channel_credentials(creds.ca)


def channel(address: str, max_message_bytes: int = 64 << 20, interceptors: Iterable[Any] = (),
            balance: bool = True, credentials: security.Credentials | None = None) -> grpc.aio.Channel:
    """A TLS client channel with raised limits, retries, keepalive and, when tracing is on, trace
    propagation (`TracedChannel`). It presents `credentials` (default: this process's,
    `security.local_credentials()`): the certificate where there is one, and the token on every call.

    `balance` spreads calls round-robin over every address a name resolves to
    (`dns:///session-server:50051`), so scaled replicas share the load; turn it off for a peer whose
    state lives on one replica (a sandbox exists only on the manager that created it)."""

    options: list[tuple[str, Any]] = [*message_options(max_message_bytes), ("grpc.enable_retries", 1),
                                      ("grpc.keepalive_time_ms", 30_000), *RECONNECT_BACKOFF]
    if balance:
        options.append(("grpc.lb_policy_name", "round_robin"))
    if security.plaintext() and credentials is None:
        raw = grpc.aio.insecure_channel(address, options=options, interceptors=list(interceptors) or None)
        return TracedChannel(raw) if tracing_enabled() else raw
    creds = credentials or security.local_credentials()
    raw = grpc.aio.secure_channel(address, channel_credentials(creds), options=options,
                                  interceptors=list(interceptors) or None)
    authed = AuthChannel(raw, creds.token) if creds.token else raw
    return TracedChannel(authed) if tracing_enabled() else authed


def blocking_channel(address: str, options: Iterable[tuple[str, Any]] = (),
                     credentials: security.Credentials | None = None) -> grpc.Channel:
    """A synchronous TLS channel with this process's credentials (scripts and threads that are not
    on an event loop); the token goes in each call's metadata.

    Not as grpc call credentials: their plugin is released on a gRPC thread that takes the GIL, and
    closing the process's last channel waits for gRPC's threads with the GIL held (grpc/grpc#42247),
    a deadlock seen here as a test hung for good in `Channel.close()`."""
    creds = credentials or security.local_credentials()
    raw = grpc.secure_channel(address, channel_credentials(creds), options=[*RECONNECT_BACKOFF, *options])
    return grpc.intercept_channel(raw, _BearerToken(creds.token)) if creds.token else raw


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """`authorization: Bearer <token>` on every call of a blocking channel that brings none."""

    def __init__(self, token: str) -> None:
        self.header = ("authorization", f"Bearer {token}")

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = list(details.metadata or ())
        if not any(key == "authorization" for key, _ in metadata):
            metadata.insert(0, self.header)
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            details.wait_for_ready, details.compression)

    def _intercept(self, continuation: Callable, details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    # One body for the four kinds of call (the request is a message or an iterator of them).
    intercept_unary_unary = intercept_unary_stream = _intercept
    intercept_stream_unary = intercept_stream_stream = _intercept


class _CallDetails(NamedTuple):
    """grpc.ClientCallDetails is an abstract class with no constructor: a call's details as fields."""

    method: str
    timeout: float | None
    metadata: list[tuple[str, str]] | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


grpc.ClientCallDetails.register(_CallDetails)


class _WrappedChannel:
    """A client channel over `inner` that is `inner` in all but what a subclass defines."""

    def __init__(self, inner: grpc.aio.Channel) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def __aenter__(self) -> Self:
        await self._inner.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> Any:
        return await self._inner.__aexit__(*exc)


class AuthChannel(_WrappedChannel):
    """A client channel whose unary calls carry `authorization: Bearer <token>`, added to the call's
    metadata (not as grpc call credentials, which run a Python plugin on a thread for every call). A
    call that brings its own `authorization` (on a caller's behalf) keeps it."""

    def __init__(self, inner: grpc.aio.Channel, token: str) -> None:
        super().__init__(inner)
        self._header = (("authorization", f"Bearer {token}"),)

    def unary_unary(self, method: str | bytes, *args: Any, **kwargs: Any) -> _AuthedCall:
        return _AuthedCall(self._inner.unary_unary(method, *args, **kwargs), self._header)

    def unary_stream(self, method: str | bytes, *args: Any, **kwargs: Any) -> _AuthedCall:
        return _AuthedCall(self._inner.unary_stream(method, *args, **kwargs), self._header)

    def stream_stream(self, method: str | bytes, *args: Any, **kwargs: Any) -> _AuthedCall:
        return _AuthedCall(self._inner.stream_stream(method, *args, **kwargs), self._header)

    def stream_unary(self, method: str | bytes, *args: Any, **kwargs: Any) -> _AuthedCall:
        return _AuthedCall(self._inner.stream_unary(method, *args, **kwargs), self._header)


class _AuthedCall:
    def __init__(self, call: Any, header: tuple[tuple[str, str], ...]) -> None:
        self.call = call
        self.header = header

    def __call__(self, *args: Any, metadata: Any = None, **kwargs: Any) -> Any:
        if not metadata:
            metadata = self.header
        elif not any(key == "authorization" for key, _ in metadata):
            metadata = (*self.header, *metadata)
        return self.call(*args, metadata=metadata, **kwargs)


class TracedChannel(_WrappedChannel):
    """A client channel whose unary calls each get the CLIENT span the OpenTelemetry gRPC client
    instrumentation records (named after the method, with its attributes) and carry the trace context
    in their metadata, so the server's span continues the trace.

    Not a grpc.aio client interceptor: an intercepted call takes a much slower path through grpc.aio,
    a few hundred microseconds of CPU per call, several calls per episode turn. Stubs are built over
    it as over any channel (`SessionServiceStub(TracedChannel(raw))`); everything but `unary_unary`
    is the wrapped channel's."""

    def __init__(self, inner: grpc.aio.Channel, tracer: Any = None) -> None:
        from opentelemetry import trace

        super().__init__(inner)
        # The instrumentation's scope name, so these spans look the same downstream.
        self._tracer = tracer or trace.get_tracer("opentelemetry.instrumentation.grpc._client")

    def unary_unary(self, method: str | bytes, *args: Any, **kwargs: Any) -> _TracedUnary:
        return _TracedUnary(self._tracer, method, self._inner.unary_unary(method, *args, **kwargs))


class _TracedUnary:
    def __init__(self, tracer: Any, method: str | bytes, call: Any) -> None:
        self.tracer = tracer
        self.call = call
        self.name = method.decode() if isinstance(method, bytes) else method
        service, _, rpc = self.name.lstrip("/").rpartition("/")
        # Built once: the attributes the instrumentation sets on a client span.
        self.attributes = {"rpc.system": "grpc", "rpc.grpc.status_code": grpc.StatusCode.OK.value[0],
                           "rpc.method": rpc, "rpc.service": service}

    # `timeout` is grpc's keyword: the deadline travels with the call to the server.
    async def __call__(self, request: Any, *, timeout: float | None = None, metadata: Any = None,  # noqa: ASYNC109
                       **kwargs: Any):
        from opentelemetry import propagate, trace
        from opentelemetry.instrumentation.utils import is_instrumentation_enabled
        from opentelemetry.trace.status import Status, StatusCode

        if not is_instrumentation_enabled():
            return await self.call(request, timeout=timeout, metadata=metadata, **kwargs)
        with self.tracer.start_as_current_span(self.name, kind=trace.SpanKind.CLIENT,
                                               attributes=self.attributes, record_exception=False,
                                               set_status_on_exception=False) as span:
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            metadata = (*(metadata or ()), *((k.lower(), v) for k, v in carrier.items()))
            try:
                return await self.call(request, timeout=timeout, metadata=metadata, **kwargs)
            except grpc.aio.AioRpcError as exc:
                span.set_attribute("rpc.grpc.status_code", exc.code().value[0])
                span.set_status(Status(status_code=StatusCode.ERROR,
                                       description=f"{type(exc).__name__}: {exc}"))
                span.record_exception(exc)
                raise


async def check_health(address: str, service: str = "", timeout_s: float = 2.0,
                       credentials: security.Credentials | None = None) -> bool:
    async with channel(address, balance=False, credentials=credentials) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
