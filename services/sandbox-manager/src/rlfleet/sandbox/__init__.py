"""rlfleet.sandbox: per-episode isolated sandboxes (driver interface + the bubblewrap driver)."""

from rlfleet.sandbox.driver import (
    ExecResult,
    FileInfo,
    SandboxDriver,
    SandboxHandle,
    SandboxRef,
    SandboxSpec,
    Violation,
    ViolationKind,
)
from rlfleet.sandbox.errors import (
    InvalidSandboxRequest,
    SandboxCapacityExhausted,
    SandboxDriverUnavailable,
    SandboxError,
    SandboxNotFound,
    SandboxQuotaExceeded,
)
from rlfleet.sandbox.limits import LIMIT_RANGES, Limits

__all__ = [
    "LIMIT_RANGES",
    "ExecResult",
    "FileInfo",
    "InvalidSandboxRequest",
    "Limits",
    "SandboxCapacityExhausted",
    "SandboxDriver",
    "SandboxDriverUnavailable",
    "SandboxError",
    "SandboxHandle",
    "SandboxNotFound",
    "SandboxQuotaExceeded",
    "SandboxRef",
    "SandboxSpec",
    "Violation",
    "ViolationKind",
]
