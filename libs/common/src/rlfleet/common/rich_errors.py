"""gRPC's standard rich-error model: an error's structured fields travel with its status.

The servicer boundary (`grpc_server.ErrorInterceptor`) sends every expected error as a
`google.rpc.Status` in the `grpc-status-details-bin` trailer, as Google's APIs do, so a client in
any language reads fields rather than message text:

- `ErrorInfo`: `reason` (the error's kind, e.g. `SESSION_NOT_FOUND`), `domain` (`rlfleet.session`)
  and `metadata` (its structured fields as strings: `session_id`, `field`, `state`, ...);
- `BadRequest` with one field violation when the error names a `field`;
- `RetryInfo` when it says when to retry (`retry_after_s`, backpressure).

`error_details(exc)` reads them back from a failed call (`grpc.RpcError`, aio ones included).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from rlfleet.common.errors import RlfleetError, clip


def reason_of(exc: RlfleetError) -> str:
    """The error's kind in ErrorInfo's UPPER_SNAKE_CASE: `SessionNotFound` -> `SESSION_NOT_FOUND`."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", type(exc).__name__).upper()


def domain_of(exc: RlfleetError) -> str:
    """The package that raised it: `rlfleet.session.errors` -> `rlfleet.session`."""
    parts = type(exc).__module__.split(".")
    return ".".join(parts[:2]) if parts[0] == "rlfleet" else parts[0]


def _packed(message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def rich_status(exc: RlfleetError) -> grpc.Status:
    """The status an expected error is sent with: its code, message and structured details. Every
    text in it is clipped (errors.clip): an error never echoes a large input back whole."""
    fields = {k: v for k, v in exc.details.items() if v is not None}
    details = [_packed(error_details_pb2.ErrorInfo(
        reason=reason_of(exc), domain=domain_of(exc), metadata={k: clip(str(v)) for k, v in fields.items()}))]
    if "field" in fields:
        violation = error_details_pb2.BadRequest.FieldViolation(field=clip(str(fields["field"])),
                                                                description=clip(exc.message, 600))
        details.append(_packed(error_details_pb2.BadRequest(field_violations=[violation])))
    if "retry_after_s" in fields:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(float(fields["retry_after_s"]) * 1e9))
        details.append(_packed(error_details_pb2.RetryInfo(retry_delay=delay)))
    status = status_pb2.Status(code=exc.status.value[0], message=clip(exc.message, 600), details=details)
    return rpc_status.to_status(status)


@dataclass
class ErrorDetails:
    """What a failed call's rich status says (empty fields when the server sent none)."""

    code: grpc.StatusCode
    message: str
    reason: str = ""
    domain: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    field_violations: dict[str, str] = field(default_factory=dict)  # field -> description
    retry_after_s: float | None = None

    @property
    def field(self) -> str | None:
        """The request field that was wrong, when the error names one."""
        return next(iter(self.field_violations), None) or self.metadata.get("field")


def error_details(exc: grpc.RpcError) -> ErrorDetails:
    """Reads the rich status of a failed call; a call without one gives just its code and message."""
    found = ErrorDetails(exc.code(), exc.details() or "")
    try:
        status = rpc_status.from_call(exc)
    except ValueError:  # a trailer that does not match the call's own status: not ours to trust
        return found
    for packed in status.details if status is not None else ():
        if packed.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            packed.Unpack(info)
            found.reason, found.domain, found.metadata = info.reason, info.domain, dict(info.metadata)
        elif packed.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            packed.Unpack(bad)
            found.field_violations.update({v.field: v.description for v in bad.field_violations})
        elif packed.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            packed.Unpack(retry)
            found.retry_after_s = retry.retry_delay.ToNanoseconds() / 1e9
    return found
