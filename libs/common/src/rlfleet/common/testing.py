"""The pytest plugin of every package's tests: real `nats-server -js` and `redis-server` on free
ports, one each per test session, stopped by PID.

Registered by the root conftest (`pytest_plugins`), so any test can ask for `nats_url` and
`redis_url`. It imports pytest, which is in rlfleet-common's `testing` extra; the process harness
itself (`rlfleet.common.processes`) needs no pytest and is what benchmarks and the launcher use.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from rlfleet.common.processes import start_nats, start_redis


@pytest.fixture(scope="session")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = start_nats(tmp_path_factory.mktemp("nats"))
    yield server.url
    server.stop(10)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server.url
    server.stop(10)


def unique_run_id(prefix: str = "t") -> str:
    """A run ID no other test uses, so tests sharing one NATS/Redis never see each other's data."""
    return f"{prefix}{os.getpid()}{time.monotonic_ns() % 10**9}"


class BackgroundRun:
    """A long command (an `rlfleet run`) in the background, its output collected line by line, so a
    test can watch it, kill what it starts, and show the end of its output when an assertion fails."""

    def __init__(self, argv: list[str]) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def output(self, last: int | None = None) -> str:
        text = "\n".join(self.lines)
        return text if last is None else text[-last:]

    def wait(self, timeout: float = 600) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(5)
        return code
