"""Test helpers: real `nats-server -js` and `redis-server` on free ports, stopped by PID.

Registered as a pytest plugin by the root conftest, so every package's tests can ask for
`nats_url` and `redis_url` fixtures (one server each per test session).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _binary(name: str) -> str:
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} not found; run `make install`")
    return found


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_nats(directory: Path) -> tuple[str, subprocess.Popen]:
    directory.mkdir(parents=True, exist_ok=True)
    binary = _binary("nats-server")
    conf = directory / "nats.conf"
    conf.write_text(f"listen: 127.0.0.1:-1\nmax_payload: {8 << 20}\nports_file_dir: {json.dumps(str(directory))}\n"
                    f"jetstream {{ store_dir: {json.dumps(str(directory / 'js'))} }}\n")
    proc = subprocess.Popen([binary, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ports = directory / f"{Path(binary).name}_{proc.pid}.ports"
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if ports.exists():
            try:
                return json.loads(ports.read_text())["nats"][0], proc
            except (json.JSONDecodeError, KeyError):
                pass
        time.sleep(0.05)
    _stop(proc)
    raise RuntimeError("nats-server did not start")


def start_redis(directory: Path) -> tuple[str, subprocess.Popen]:
    directory.mkdir(parents=True, exist_ok=True)
    for _ in range(5):
        port = free_port()
        proc = subprocess.Popen([_binary("redis-server"), "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                                 "--appendonly", "no", "--dir", str(directory)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    return f"redis://127.0.0.1:{port}/0", proc
            time.sleep(0.05)
        _stop(proc)
    raise RuntimeError("redis-server did not start")


@pytest.fixture(scope="session")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url, proc = start_nats(tmp_path_factory.mktemp("nats"))
    yield url
    _stop(proc)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url, proc = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    _stop(proc)


def unique_run_id(prefix: str = "t") -> str:
    """A run ID no other test uses, so tests sharing one NATS/Redis never see each other's data."""
    return f"{prefix}{os.getpid()}{time.monotonic_ns() % 10**9}"
