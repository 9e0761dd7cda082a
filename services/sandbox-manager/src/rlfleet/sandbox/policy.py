"""What a create or exec request may ask for: the manager's defaults and maxima applied to it.

Zero means "the default" (proto3 cannot tell unset from 0); a value above the manager's maximum is
an error naming the field, never silently clamped, and the platform's hard ranges
(`rlfleet.sandbox.limits.LIMIT_RANGES`) are checked by `Limits` itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from rlfleet.sandbox.errors import InvalidSandboxRequest
from rlfleet.sandbox.limits import LIMIT_RANGES, Limits


@dataclass(frozen=True)
class RequestPolicy:
    default_limits: Limits
    max_limits: Limits
    default_ttl_s: float
    max_ttl_s: float
    allow_network: bool

    def limits(self, requested: Mapping[str, float]) -> Limits:
        values: dict[str, float] = {}
        for name in LIMIT_RANGES:
            value = requested.get(name, 0)
            if value == 0:
                value = getattr(self.default_limits, name)
            elif value > getattr(self.max_limits, name):
                field = f"limits.{name}"
                raise InvalidSandboxRequest(
                    f"{field}={value!r} is above this manager's maximum {getattr(self.max_limits, name)!r}",
                    field=field, value=value, maximum=getattr(self.max_limits, name))
            values[name] = value
        # from_mapping takes the values as they came: Limits checks each one's type itself.
        return Limits.from_mapping(values)

    def ttl(self, requested: float) -> float:
        if requested == 0:
            return self.default_ttl_s
        if math.isnan(requested) or not 0 < requested <= self.max_ttl_s:
            raise InvalidSandboxRequest(f"ttl_seconds={requested!r} is out of range (0, {self.max_ttl_s:g}]",
                                        field="ttl_seconds", value=requested, maximum=self.max_ttl_s)
        return requested

    def network(self, requested: bool) -> bool:
        if requested and not self.allow_network:
            raise InvalidSandboxRequest("network access is disabled on this sandbox manager (allow_network)",
                                        field="network")
        return requested

    def exec_timeout(self, requested: float) -> float | None:
        """None: the sandbox's own wall limit."""
        if requested == 0:
            return None
        lo = LIMIT_RANGES["wall_seconds"][0]
        if math.isnan(requested) or not lo <= requested <= self.max_limits.wall_seconds:
            raise InvalidSandboxRequest(
                f"timeout_seconds={requested!r} is out of range [{lo:g}, {self.max_limits.wall_seconds:g}]",
                field="timeout_seconds")
        return requested
