"""Sandbox errors carry structured fields and the gRPC status their shared kind maps to."""

from __future__ import annotations

import grpc

from rlfleet.common.errors import status_for
from rlfleet.sandbox import (
    InvalidSandboxRequest,
    SandboxCapacityExhausted,
    SandboxDriverUnavailable,
    SandboxError,
    SandboxNotFound,
)


def test_each_error_maps_to_the_status_the_servicer_should_return():
    cases = {
        SandboxNotFound("abc", "expired"): grpc.StatusCode.NOT_FOUND,
        InvalidSandboxRequest("bad", field="argv"): grpc.StatusCode.INVALID_ARGUMENT,
        SandboxCapacityExhausted("full", capacity=4): grpc.StatusCode.RESOURCE_EXHAUSTED,
        SandboxDriverUnavailable("no bwrap", reason="bwrap_missing"): grpc.StatusCode.UNAVAILABLE,
    }
    for error, status in cases.items():
        assert isinstance(error, SandboxError)
        assert status_for(error) == (status, str(error))


def test_errors_keep_their_fields_for_callers_and_logs():
    e = SandboxNotFound("abc", "expired")
    assert (e.sandbox_id, e.reason) == ("abc", "expired")
    assert e.details == {"sandbox_id": "abc", "reason": "expired"}
    bad = InvalidSandboxRequest("path 'x' is bad", field="path", path="x")
    assert bad.field == "path" and bad.details["path"] == "x"
    full = SandboxCapacityExhausted("full", capacity=4)
    assert full.capacity == 4 and full.retry_after_s > 0
