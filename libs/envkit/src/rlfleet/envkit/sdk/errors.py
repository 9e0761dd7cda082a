"""Errors of the environment SDK's service calls, one class per way a caller reacts to them.

gRPC statuses are translated once, in :mod:`rlfleet.envkit.sdk.clients`; everything above works
with these classes and their structured fields (`service`, `method`, `code`, and `error`: what the
service said in its rich status, `reason`, `field`, `metadata`, `retry_after_s`), never with the
message text.
"""

from __future__ import annotations

import grpc

from rlfleet.common.rich_errors import ErrorDetails, error_details
from rlfleet.envkit.errors import EnvkitError


class RpcError(EnvkitError):
    """A call to an rlfleet service failed."""

    def __init__(self, service: str, method: str, code: grpc.StatusCode, details: str,
                 error: ErrorDetails | None = None) -> None:
        self.service = service
        self.method = method
        self.code = code
        self.details = details
        self.error = error or ErrorDetails(code, details)
        super().__init__(f"{service}.{method}: {code.name}: {details}")


class Backpressure(RpcError):
    """RESOURCE_EXHAUSTED: the service is full right now; retry later (admission, sandbox slots)."""


class PeerUnavailable(RpcError):
    """UNAVAILABLE or DEADLINE_EXCEEDED: the service (or one behind it) cannot be reached in time."""


class RpcNotFound(RpcError):
    """NOT_FOUND: the session, sandbox or task does not exist (anymore)."""


class RequestRejected(RpcError):
    """INVALID_ARGUMENT, FAILED_PRECONDITION, ALREADY_EXISTS: the request cannot succeed as it is."""


class RpcUnimplemented(RpcError):
    """UNIMPLEMENTED: the service does not offer this RPC (yet)."""


_CLASSES: dict[grpc.StatusCode, type[RpcError]] = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: Backpressure,
    grpc.StatusCode.UNAVAILABLE: PeerUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: PeerUnavailable,
    grpc.StatusCode.NOT_FOUND: RpcNotFound,
    grpc.StatusCode.INVALID_ARGUMENT: RequestRejected,
    grpc.StatusCode.FAILED_PRECONDITION: RequestRejected,
    grpc.StatusCode.ALREADY_EXISTS: RequestRejected,
    grpc.StatusCode.UNIMPLEMENTED: RpcUnimplemented,
}


def translate(service: str, method: str, exc: grpc.aio.AioRpcError) -> RpcError:
    code = exc.code()
    return _CLASSES.get(code, RpcError)(service, method, code, exc.details() or "", error_details(exc))


class EpisodeError(EnvkitError):
    """An episode could not run to its end for a reason outside the policy (the environment failed)."""


class Superseded(EpisodeError):
    """The episode's session was aborted by someone else (a newer delivery of its task owns it now)."""


class SandboxFailure(EnvkitError):
    """The sandbox failed a call in a way the policy did not cause (e.g. a built-in tool killed with no
    limit violation recorded). Transient: the episode is aborted and runs again on redelivery."""
