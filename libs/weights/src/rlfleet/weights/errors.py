"""Errors of the weight store.

One small hierarchy with structured fields, so a caller (an engine, the
broker) can branch on the type and log the fields without parsing messages.
Map to gRPC codes only at a servicer boundary: ``VersionNotFound`` ->
NOT_FOUND, ``PathOutsideStore`` -> INVALID_ARGUMENT, ``CorruptVersion`` and
``BaseVersionMismatch`` -> FAILED_PRECONDITION, ``VersionExists`` ->
ALREADY_EXISTS.
"""

from __future__ import annotations


class WeightStoreError(Exception):
    """Base class of every error raised by ``rlfleet.weights``."""


class VersionNotFound(WeightStoreError):
    """The version (or a file it needs) is not in the store."""

    def __init__(self, version: int | None, detail: str = "") -> None:
        self.version = version
        self.detail = detail
        super().__init__(f"version {version} not found" + (f": {detail}" if detail else ""))


class VersionExists(WeightStoreError):
    """A version directory already exists; versions are immutable once written."""

    def __init__(self, version: int) -> None:
        self.version = version
        super().__init__(f"version {version} already exists (versions are write-once)")


class CorruptVersion(WeightStoreError):
    """Stored bytes do not decode, or decode to weights whose checksum is wrong."""

    def __init__(self, version: int | None, detail: str, tensor: str | None = None) -> None:
        self.version = version
        self.tensor = tensor
        self.detail = detail
        where = f" tensor {tensor!r}" if tensor else ""
        super().__init__(f"version {version}{where}: {detail}")


class CorruptDelta(CorruptVersion):
    """A delta is unreadable (truncated, bad zstd frame, bad index) or applying it
    does not give the trainer's checksum. After a failed in-place apply the
    engine's tensors are in an unknown state: reload them with ``recover()``."""


class CorruptCheckpoint(CorruptVersion):
    """A full checkpoint is unreadable or a tensor's checksum does not match."""


class BaseVersionMismatch(WeightStoreError):
    """A delta was offered to tensors that are not its base version (wrong version,
    already applied, or a tensor's name/shape/dtype differs from the base)."""

    def __init__(self, expected: int | None, actual: int | None, detail: str = "") -> None:
        self.expected = expected
        self.actual = actual
        self.detail = detail
        msg = f"delta needs base version {expected}, tensors are at {actual}"
        super().__init__(msg + (f": {detail}" if detail else ""))


class PathOutsideStore(WeightStoreError):
    """A user-supplied path or URI resolves outside the store's root."""

    def __init__(self, path: str, root: str) -> None:
        self.path = path
        self.root = root
        super().__init__(f"path {path!r} is outside the weight store root {root!r}")
