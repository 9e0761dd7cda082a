"""The session domain's errors.

Each one also subclasses the shared kind it is (`rlfleet.common.errors`), so the servicer boundary
maps it to a gRPC status without knowing about sessions. Fields are structured so that a caller (or
a log query) never has to parse a message.
"""

from __future__ import annotations

from typing import Any

from rlfleet.common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    RlfleetError,
    Unavailable,
)


class SessionError(RlfleetError):
    """Base of every session error; `session_id` is set when the error concerns one session."""

    def __init__(self, message: str, *, session_id: str | None = None, **details: Any) -> None:
        super().__init__(message, session_id=session_id, **details)
        self.session_id = session_id


class InvalidSessionRequest(SessionError, InvalidArgument):
    """The request is malformed; `field` names the offending input."""

    def __init__(self, message: str, *, field: str, session_id: str | None = None, **details: Any) -> None:
        super().__init__(message, session_id=session_id, field=field, **details)
        self.field = field


class ObservationOverBudget(InvalidSessionRequest):
    """An observation that does not fit what is left of the session's token budget: the client closes
    the session as TRUNCATED instead (ErrorInfo reason OBSERVATION_OVER_BUDGET)."""


class SessionNotFound(SessionError, NotFound):
    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} not found (never opened, or expired)",
                         session_id=session_id)


class SessionNotOpen(SessionError, FailedPrecondition):
    """The session is closed or aborted (`state`), or its budget is spent."""

    def __init__(self, message: str, *, session_id: str, state: str) -> None:
        super().__init__(message, session_id=session_id, state=state)
        self.state = state


class ConcurrentSessionCall(SessionError, FailedPrecondition):
    """Another call changed the session while this one ran; this one's change was discarded."""


class SessionBusy(ConcurrentSessionCall):
    """A Generate is already running on the session; this one was refused before any engine work."""


class SessionExists(SessionError, AlreadyExists):
    """OpenSession with the id of a session opened with another prompt (or task)."""


class SessionsExhausted(SessionError, ResourceExhausted):
    """No new session now: too many open here, or the gateway refused admission (`reason`)."""

    def __init__(self, message: str, *, reason: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message, reason=reason, retry_after_s=retry_after_s)
        self.reason = reason


class GatewayUnavailable(SessionError, Unavailable):
    """The gateway (or every engine behind it) cannot serve the call now."""


class FirstTurnPending(SessionError, Unavailable):
    """A retried OpenSession whose first turn another call is still generating (its server alive and
    renewing the turn lease): retry the open after `retry_after_s`, which then answers with that turn."""

    def __init__(self, message: str, *, session_id: str, retry_after_s: float) -> None:
        super().__init__(message, session_id=session_id, retry_after_s=retry_after_s)


class GatewayRejected(SessionError, InvalidArgument):
    """The gateway or its engine found the request invalid; the message is theirs."""


class PublishFailed(SessionError, Unavailable):
    """JetStream did not acknowledge the trajectory; closing again publishes it (once)."""
