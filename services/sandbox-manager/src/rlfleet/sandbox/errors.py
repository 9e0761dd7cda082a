"""The sandbox domain's errors.

Each one also subclasses the shared error kind it is (see `rlfleet.common.errors`), so the servicer
boundary maps it to a gRPC status without knowing about sandboxes. Fields are structured so that a
caller (or a log query) never has to parse a message.
"""

from __future__ import annotations

from typing import Any

from rlfleet.common.errors import InvalidArgument, NotFound, ResourceExhausted, RlfleetError, Unavailable


class SandboxError(RlfleetError):
    """Base of every sandbox error; `sandbox_id` is set when the error concerns one sandbox."""

    def __init__(self, message: str, *, sandbox_id: str | None = None, **details: Any) -> None:
        super().__init__(message, sandbox_id=sandbox_id, **details)
        self.sandbox_id = sandbox_id


class SandboxNotFound(SandboxError, NotFound):
    """No live sandbox has this id (never created, destroyed, or expired: see `reason`)."""

    def __init__(self, sandbox_id: str, reason: str = "unknown") -> None:
        super().__init__(f"sandbox {sandbox_id!r} not found ({reason})", sandbox_id=sandbox_id, reason=reason)
        self.reason = reason


class InvalidSandboxRequest(SandboxError, InvalidArgument):
    """The request is malformed; `field` names the offending input (e.g. `limits.cpu_seconds`, `path`)."""

    def __init__(self, message: str, *, field: str, sandbox_id: str | None = None, **details: Any) -> None:
        super().__init__(message, sandbox_id=sandbox_id, field=field, **details)
        self.field = field


class SandboxCapacityExhausted(SandboxError, ResourceExhausted):
    """Every sandbox slot (one unprivileged uid each) is in use; retry after some are destroyed."""

    def __init__(self, message: str, *, capacity: int) -> None:
        super().__init__(message, capacity=capacity)
        self.capacity = capacity
        self.retry_after_s = 1.0


class SandboxQuotaExceeded(SandboxError, ResourceExhausted):
    """A quota was reached: a workspace's size or file count, or a client's or run's open sandboxes.

    `quota` names it (`workspace_bytes`, `workspace_inodes`, `sandboxes_per_client`, ...) and `limit`
    is its value; retrying only helps once something is freed (files deleted, sandboxes destroyed)."""

    def __init__(self, message: str, *, quota: str, limit: int, sandbox_id: str | None = None,
                 **details: Any) -> None:
        super().__init__(message, sandbox_id=sandbox_id, quota=quota, limit=limit, **details)
        self.quota, self.limit = quota, limit
        self.retry_after_s = 1.0


class SandboxDriverUnavailable(SandboxError, Unavailable):
    """The isolation driver cannot work on this host (missing tool, no privileges, setup failure)."""

    def __init__(self, message: str, *, reason: str, sandbox_id: str | None = None, **details: Any) -> None:
        super().__init__(message, sandbox_id=sandbox_id, reason=reason, **details)
        self.reason = reason
