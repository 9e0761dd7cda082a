"""What a create or exec request may ask for: zero means the default, above the maximum is an error naming
the field."""

from __future__ import annotations

import pytest

from rlfleet.common.config import ConfigError, load_config
from rlfleet.sandbox import InvalidSandboxRequest, Limits
from rlfleet.sandbox.config import SandboxManagerConfig
from rlfleet.sandbox.limits import GiB, MiB
from rlfleet.sandbox.policy import RequestPolicy

POLICY = RequestPolicy(Limits(), Limits(cpu_seconds=60, memory_bytes=2 * GiB, wall_seconds=120,
                                        max_processes=256, max_file_bytes=1 * GiB, max_output_bytes=8 * MiB),
                       default_ttl_s=600, max_ttl_s=3600, allow_network=False)


def test_zero_limits_take_the_defaults_and_given_ones_are_kept():
    assert POLICY.limits({}) == Limits()
    assert POLICY.limits({"cpu_seconds": 0, "wall_seconds": 5, "memory_bytes": 64 * MiB}) == Limits(
        wall_seconds=5, memory_bytes=64 * MiB)


@pytest.mark.parametrize(("name", "value"), [("memory_bytes", 3 * GiB), ("cpu_seconds", 61),
                                             ("max_processes", 257), ("max_output_bytes", 9 * MiB),
                                             ("wall_seconds", float("inf"))])
def test_a_limit_above_the_managers_maximum_is_rejected_with_its_field(name, value):
    with pytest.raises(InvalidSandboxRequest) as err:
        POLICY.limits({name: value})
    assert err.value.field == f"limits.{name}" and "maximum" in str(err.value)


@pytest.mark.parametrize(("name", "value"), [("cpu_seconds", 0.5), ("wall_seconds", -1.0),
                                             ("memory_bytes", 1), ("cpu_seconds", float("nan"))])
def test_a_limit_below_the_platform_range_is_rejected_with_its_field(name, value):
    with pytest.raises(InvalidSandboxRequest) as err:
        POLICY.limits({name: value})
    assert err.value.field == f"limits.{name}"


def test_ttl_network_and_exec_timeout_follow_the_policy():
    assert POLICY.ttl(0) == 600 and POLICY.ttl(5) == 5
    for bad in (-1, 3601, float("nan")):
        with pytest.raises(InvalidSandboxRequest, match="ttl_seconds"):
            POLICY.ttl(bad)
    assert POLICY.network(False) is False
    with pytest.raises(InvalidSandboxRequest, match="allow_network"):
        POLICY.network(True)
    assert POLICY.exec_timeout(0) is None and POLICY.exec_timeout(2.5) == 2.5
    for bad in (-1, 0.01, 121):
        with pytest.raises(InvalidSandboxRequest, match="timeout_seconds"):
            POLICY.exec_timeout(bad)


def test_config_rejects_defaults_above_maxima_and_limits_outside_the_platform_ranges():
    config = load_config(SandboxManagerConfig, ["--default-limits.wall-seconds", "5"], prog="t", environ={})
    assert config.default_limits.as_limits().wall_seconds == 5
    with pytest.raises(ConfigError, match="default_limits.cpu_seconds=.* is above max_limits.cpu_seconds"):
        load_config(SandboxManagerConfig, ["--default-limits.cpu-seconds", "1000"], prog="t", environ={})
    with pytest.raises(ConfigError, match="limits.memory_bytes"):
        load_config(SandboxManagerConfig, ["--max-limits.memory-bytes", "1"], prog="t", environ={})
    with pytest.raises(ConfigError, match="cgroups"):
        load_config(SandboxManagerConfig, ["--driver.cgroups", "maybe"], prog="t", environ={})
