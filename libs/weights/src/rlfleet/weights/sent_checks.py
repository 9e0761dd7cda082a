"""The torch-free half of rlfleet.weights.sent: comparing the checksums a trainer sent with those an
engine reports, for the broker (a light service: it never imports torch)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DEFAULT_ALGORITHM = "sha256"


def mismatched(expected: Mapping[str, str], got: Mapping[str, Any]) -> list[str]:
    """Names whose checksum differs or is missing on either side (empty: the transfer is whole)."""
    return sorted(n for n in set(expected) | set(got) if expected.get(n) != got.get(n))
