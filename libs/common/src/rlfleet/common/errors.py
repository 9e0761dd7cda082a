"""The error kinds every service raises, and their one translation to gRPC status codes.

Domain code raises subclasses of these (e.g. `class SandboxNotFound(SandboxError, NotFound)`),
with structured fields; only the servicer boundary (the interceptor in `grpc_server`) turns them
into statuses. Anything else that escapes a handler is an INTERNAL error and is logged with its
traceback, never swallowed.
"""

from __future__ import annotations

import time
from typing import Any

import grpc

# What an error message may echo of its input: a 4 MB id in a NOT_FOUND would come back whole, and
# a status over the client's limit arrives as RESOURCE_EXHAUSTED instead of the real error.
MAX_ECHO_CHARS = 300


def clip(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """`text` cut to `limit` characters, saying how long it was."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters in all)"


class RlfleetError(Exception):
    """Base of all expected errors; `message` is what the caller sees."""

    status = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, **details: Any) -> None:
        message = clip(message, 2 * MAX_ECHO_CHARS)  # room for the words around one echoed value
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


def unknown_enum(message: Any, where: str = "") -> tuple[str, int] | None:
    """(field path, value) of the first enum field anywhere in `message` holding a value its enum
    does not define (proto3 keeps unknown numbers, so a newer or hostile client can send any)."""
    for field, value in message.ListFields():
        path = f"{where}.{field.name}" if where else field.name
        if field.enum_type is not None:
            values = value if field.is_repeated else [value]
            for number in values:
                if field.enum_type.values_by_number.get(number) is None:
                    return path, number
        elif field.message_type is not None and not field.message_type.GetOptions().map_entry:
            for child in (value if field.is_repeated else [value]):
                found = unknown_enum(child, path)
                if found:
                    return found
    return None


def require_known_enums(message: Any) -> None:
    """INVALID_ARGUMENT naming the field when an enum in the request has an undefined value."""
    found = unknown_enum(message)
    if found is not None:
        path, number = found
        raise InvalidArgument(f"{path}: {number} is not a known value", field=path)


class OncePerPeer:
    """Says whether to log a repeated event (an undecodable request) from one peer: at most once per
    `interval_s`, with how many were not logged since, so a flood costs one line, not a traceback each."""

    def __init__(self, interval_s: float = 60.0, max_peers: int = 4096) -> None:
        self.interval_s = interval_s
        self.max_peers = max_peers
        self._last: dict[str, tuple[float, int]] = {}  # peer -> (last logged, suppressed since)

    def should_log(self, peer: str, now: float | None = None) -> tuple[bool, int]:
        """(log it now?, how many from this peer were suppressed before this one)."""
        now = time.monotonic() if now is None else now
        last, suppressed = self._last.get(peer, (float("-inf"), 0))
        if now - last >= self.interval_s:
            if len(self._last) >= self.max_peers:
                self._last.clear()  # bounded memory under many peers; worst case a few more lines
            self._last[peer] = (now, 0)
            return True, suppressed
        self._last[peer] = (last, suppressed + 1)
        return False, suppressed + 1
