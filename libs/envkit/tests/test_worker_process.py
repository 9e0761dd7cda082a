"""The worker's and submit command's entry points: light, instant help, one-line failures."""

import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def run(*args, timeout=60):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout)


def test_the_sdk_worker_and_submit_command_do_not_import_torch():
    code = ("import sys, rlfleet.envkit.sdk, rlfleet.envkit.worker, rlfleet.envkit.submit, "
            "rlfleet.envkit.worker_main; assert 'torch' not in sys.modules, 'torch imported'")
    result = run(sys.executable, "-c", code)
    assert result.returncode == 0, result.stderr


def test_worker_help_is_instant_and_lists_its_config():
    started = time.monotonic()
    result = run(BIN / "rlfleet-worker", "--help")
    assert result.returncode == 0
    assert "--concurrency" in result.stdout and "--session-address" in result.stdout
    assert time.monotonic() - started < 5


def test_a_worker_without_a_peer_address_exits_1_with_one_line():
    result = run(BIN / "rlfleet-worker", "--run-id", "r", "--nats.url", "nats://127.0.0.1:1")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "rlfleet-worker: cannot start: session_address is required: set it in the config file, with "
        "--session_address or with RLFLEET__SESSION_ADDRESS"]


def test_a_bad_worker_config_key_exits_2():
    result = run(BIN / "rlfleet-worker", "--set", "concurency=2")
    assert result.returncode == 2 and "unknown key 'concurency'" in result.stderr
