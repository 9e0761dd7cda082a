"""Limits: validated on construction, with the offending field named; translated to rlimits."""

from __future__ import annotations

import math
import resource

import pytest

from rlfleet.sandbox import LIMIT_RANGES, InvalidSandboxRequest, Limits
from rlfleet.sandbox.limits import GiB, MiB, rlimits


def test_defaults_are_valid_and_within_the_hard_maxima():
    limits = Limits()
    for name, (lo, hi) in LIMIT_RANGES.items():
        assert lo <= getattr(limits, name) <= hi


@pytest.mark.parametrize("name", sorted(LIMIT_RANGES))
def test_each_limit_rejects_values_just_outside_its_range(name):
    lo, hi = LIMIT_RANGES[name]
    step = 1 if isinstance(getattr(Limits(), name), int) else 0.01
    for bad in (lo - step, hi + step):
        if isinstance(getattr(Limits(), name), int):
            bad = int(bad)
        with pytest.raises(InvalidSandboxRequest) as e:
            Limits(**{name: bad})
        assert e.value.field == f"limits.{name}"
        assert e.value.details["minimum"] == lo and e.value.details["maximum"] == hi
    Limits(**{name: lo})
    Limits(**{name: hi})


@pytest.mark.parametrize("bad", [True, "10", None, math.nan, math.inf])
def test_non_numbers_booleans_and_nan_are_rejected(bad):
    with pytest.raises(InvalidSandboxRequest):
        Limits(cpu_seconds=bad)


def test_byte_counts_must_be_integers():
    with pytest.raises(InvalidSandboxRequest) as e:
        Limits(memory_bytes=64.5 * MiB)
    assert "integer" in str(e.value)


def test_the_error_message_shows_the_range_in_readable_units():
    with pytest.raises(InvalidSandboxRequest) as e:
        Limits(memory_bytes=128 * GiB)
    assert "[32 MiB, 65536 MiB]" in str(e.value)


def test_replace_and_from_mapping_validate_and_refuse_unknown_keys():
    assert Limits().replace(cpu_seconds=2).cpu_seconds == 2
    assert Limits.from_mapping({"wall_seconds": 5}).wall_seconds == 5
    with pytest.raises(InvalidSandboxRequest) as e:
        Limits.from_mapping({"cpu": 1})
    assert e.value.field == "limits"
    with pytest.raises(InvalidSandboxRequest):
        Limits().replace(max_processes=0)


def test_rlimits_round_cpu_up_and_give_a_hard_limit_one_second_later():
    got = dict(rlimits(Limits(cpu_seconds=1.2, max_processes=16), limit_address_space=False, extra_tasks=2))
    assert got[resource.RLIMIT_CPU] == (2, 3)
    assert got[resource.RLIMIT_NPROC] == (18, 18)
    assert got[resource.RLIMIT_CORE] == (0, 0)
    assert got[resource.RLIMIT_FSIZE] == (64 * MiB, 64 * MiB)
    assert resource.RLIMIT_AS not in got
    with_as = dict(rlimits(Limits(), limit_address_space=True))
    assert with_as[resource.RLIMIT_AS] == (512 * MiB, 512 * MiB)
