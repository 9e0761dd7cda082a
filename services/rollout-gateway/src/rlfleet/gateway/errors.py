"""The gateway domain's errors.

Each one also subclasses the shared kind it is (`rlfleet.common.errors`), so the servicer boundary
maps it to a gRPC status without knowing about engines. Admission refusals are not errors: `Admit`
answers `admitted=false` with a reason.
"""

from __future__ import annotations

from typing import Any

from rlfleet.common.errors import InvalidArgument, NotFound, RlfleetError, Unavailable


class GatewayError(RlfleetError):
    """Base of every gateway error; `engine_id` is set when the error concerns one engine."""

    def __init__(self, message: str, *, engine_id: str | None = None, **details: Any) -> None:
        super().__init__(message, engine_id=engine_id, **details)
        self.engine_id = engine_id


class InvalidGatewayRequest(GatewayError, InvalidArgument):
    """The request is malformed; `field` names the offending input."""

    def __init__(self, message: str, *, field: str, **details: Any) -> None:
        super().__init__(message, field=field, **details)
        self.field = field


class EngineRejectedRequest(GatewayError, InvalidArgument):
    """The engine answered 4xx: the request itself is wrong; the engine's message is kept."""


class AdapterNotLoaded(GatewayError, Unavailable):
    """The engine does not hold the LoRA adapter the request's role is routed to (restarted since the
    broker loaded it there). Not the request's fault, so UNAVAILABLE: callers retry, and an episode
    counts it as a platform failure, not the task's; the broker loads it again within a round."""


class EngineNotFound(GatewayError, NotFound):
    def __init__(self, engine_id: str) -> None:
        super().__init__(f"engine {engine_id!r} is not registered", engine_id=engine_id)


class NoEngineAvailable(GatewayError, Unavailable):
    """No registered engine can take the request; `tried` lists the engines that failed it."""

    def __init__(self, message: str, *, tried: tuple[str, ...] = ()) -> None:
        super().__init__(message, tried=tried)
        self.tried = tried
