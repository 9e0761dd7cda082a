"""Fixtures for sandbox tests: real drivers on a per-test root, and helpers for containment checks."""

from __future__ import annotations

import os
import shutil
import zlib
from collections.abc import AsyncIterator

import pytest

from rlfleet.sandbox.bubblewrap import BubblewrapConfig, BubblewrapDriver

# Integration modules skip themselves with the same condition (conftest is not importable
# under --import-mode=importlib).
CAN_SANDBOX = os.geteuid() == 0 and shutil.which("bwrap") is not None


def driver_config(tmp_path, **overrides) -> BubblewrapConfig:
    # A uid range of its own per test keeps parallel test runs (and a real driver) apart.
    uid_base = 300_000 + (zlib.crc32(str(tmp_path).encode()) % 5000) * 64
    settings = {"root": tmp_path / "sandboxes", "uid_base": uid_base, "max_sandboxes": 64, "pool_size": 0}
    return BubblewrapConfig(**{**settings, **overrides})


@pytest.fixture
def driver_factory(tmp_path):
    """Build a driver with config overrides (use as `async with driver_factory(pool_size=2) as d`)."""
    return lambda **overrides: BubblewrapDriver(driver_config(tmp_path, **overrides))


@pytest.fixture
async def driver(tmp_path) -> AsyncIterator[BubblewrapDriver]:
    async with BubblewrapDriver(driver_config(tmp_path)) as d:
        yield d


@pytest.fixture(params=["cgroups", "rlimits-only"])
async def any_mode_driver(request, tmp_path) -> AsyncIterator[BubblewrapDriver]:
    """The driver with and without cgroups, for limits enforced differently in each mode."""
    mode = "auto" if request.param == "cgroups" else "off"
    async with BubblewrapDriver(driver_config(tmp_path, cgroups=mode)) as d:
        if request.param == "cgroups" and not d.uses_cgroups:
            pytest.skip("cgroups are not available on this host")
        yield d
