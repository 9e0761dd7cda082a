"""The broker's errors; the servicer boundary maps them to gRPC statuses (rlfleet.common.errors)."""

from __future__ import annotations

from rlfleet.common.errors import FailedPrecondition, InvalidArgument, NotFound


class UnknownVersion(NotFound):
    """The broker has no record of the version (never announced), or the store does not hold it."""

    def __init__(self, version: int, detail: str = "") -> None:
        super().__init__(f"version {version} is unknown" + (f": {detail}" if detail else ""), version=version)
        self.version = version


class BadAnnouncement(InvalidArgument):
    """A PolicyVersion that is malformed, of another run, or points outside the weight store."""


class NotPromotable(FailedPrecondition):
    """Promote (or PinCandidate) of a version the canary pool never served (or that was rejected, or is
    older than accepted)."""


class NothingToRollBackTo(FailedPrecondition):
    """Rollback with no accepted version older than the current one (or a target that was never accepted)."""


class UnknownSync(NotFound):
    """FinishTrainerSync of a sync the broker does not hold (never started, finished, or timed out)."""
