"""The error kinds every service raises, and their one translation to gRPC status codes.

Domain code raises subclasses of these (e.g. `class SandboxNotFound(SandboxError, NotFound)`),
with structured fields; only the servicer boundary (the interceptor in `grpc_server`) turns them
into statuses. Anything else that escapes a handler is an INTERNAL error and is logged with its
traceback, never swallowed.
"""

from __future__ import annotations

from typing import Any

import grpc


class RlfleetError(Exception):
    """Base of all expected errors; `message` is what the caller sees."""

    status = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def __str__(self) -> str:
        return self.message


class InvalidArgument(RlfleetError):
    status = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(RlfleetError):
    status = grpc.StatusCode.NOT_FOUND


class AlreadyExists(RlfleetError):
    status = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(RlfleetError):
    status = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(RlfleetError):
    """Backpressure: the caller should retry later."""

    status = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float = 1.0, **details: Any) -> None:
        super().__init__(message, retry_after_s=retry_after_s, **details)
        self.retry_after_s = retry_after_s


class Unavailable(RlfleetError):
    """A peer (engine, NATS, Redis, another service) cannot be reached."""

    status = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(RlfleetError):
    status = grpc.StatusCode.DEADLINE_EXCEEDED


class Unimplemented(RlfleetError):
    status = grpc.StatusCode.UNIMPLEMENTED


class Unauthenticated(RlfleetError):
    """No credential, or one that is not the run's (bad signature, revoked, expired)."""

    status = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(RlfleetError):
    """An authenticated caller without the right the call needs; `right` names it."""

    status = grpc.StatusCode.PERMISSION_DENIED


class StartupError(RlfleetError):
    """A service cannot start (peer unreachable, port in use); printed as one line, exit 1."""


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status an expected error maps to, or None for an unexpected one."""
    if isinstance(exc, RlfleetError):
        return exc.status, exc.message
    return None
