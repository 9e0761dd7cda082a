"""Each service's console script on its own: instant help, no torch in light services, clear failures."""

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
SCRIPTS = ["rlfleet-sandbox-manager", "rlfleet-gateway", "rlfleet-session-server", "rlfleet-verifier",
           "rlfleet-trainer", "rlfleet-weight-broker"]
LIGHT_APPS = ["rlfleet.session.app", "rlfleet.gateway.app", "rlfleet.sandbox.app", "rlfleet.verifier.app",
              "rlfleet.broker.app"]


def run(*args, timeout=60):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_is_instant_and_lists_config_fields(script):
    start = time.monotonic()
    result = run(BIN / script, "--help")
    assert result.returncode == 0
    assert "--grpc.port" in result.stdout and "--dry-run" in result.stdout
    assert time.monotonic() - start < 5  # no torch, no service import before the config is parsed


@pytest.mark.parametrize("module", LIGHT_APPS)
def test_light_services_do_not_import_torch(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch imported'"
    result = run(sys.executable, "-c", code)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_unknown_config_key_exits_2_with_one_line(script):
    result = run(BIN / script, "--set", "grcp.port=1")
    assert result.returncode == 2
    assert result.stderr.strip() == f"{script}: config error: unknown key 'grcp'"


def test_malformed_config_file_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[grpc\nport=")
    result = run(BIN / "rlfleet-gateway", "--config", bad)
    assert result.returncode == 2
    assert "is not valid TOML" in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.integration
def test_unreachable_nats_exits_1_with_one_line(redis_url):
    result = run(BIN / "rlfleet-session-server", "--nats.url", "nats://127.0.0.1:1", "--redis.url", redis_url)
    assert result.returncode == 1
    assert "cannot reach NATS at nats://127.0.0.1:1" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.integration
def test_a_grpc_port_in_use_exits_1_with_one_line(redis_url):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run(BIN / "rlfleet-gateway", "--redis.url", redis_url, "--grpc.port", port)
    assert result.returncode == 1
    assert "cannot bind gRPC" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.integration
def test_sigterm_stops_a_service_cleanly(redis_url, tmp_path):
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen([BIN / "rlfleet-gateway", "--redis.url", redis_url, "--ready-file", ready],
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists()
    proc.terminate()
    assert proc.wait(15) == 0
    assert '"msg": "stopped"' in proc.stderr.read()
