"""`rlfleet status` against a launched platform: one snapshot, JSON, the live view, and services down."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlfleet.cli.launcher import PlatformState, is_ours
from rlfleet.common.testing import unique_run_id
from rlfleet.envkit.testing import LaunchedPlatform, build_tokenizer, start_scripted_engine

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BIN = Path(sys.executable).parent
SERVICES = ("sandbox-manager", "rollout-gateway", "session-server", "verifier", "trainer", "weight-broker")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    from rlfleet.trainer.testing import write_tiny_model

    root = tmp_path_factory.mktemp("status")
    tokenizer_dir = build_tokenizer(root / "tokenizer")
    policy = write_tiny_model(root / "policy", vocab_size=512)
    engine, url = start_scripted_engine(tokenizer_dir, root)
    platform = LaunchedPlatform(root / "run", unique_run_id("status"), tokenizer_dir, engine_url=url,
                                services=SERVICES, sections={"trainer": {"model_path": str(policy)}})
    try:
        platform.up()
        wait_for_trainer(platform.run_dir)
        yield platform
    finally:
        platform.down()
        engine.stop()


def status(run_dir: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "rlfleet"), "status", "--run-dir", str(run_dir), *flags],
                          capture_output=True, text=True, timeout=60)


def wait_for_trainer(run_dir: Path, timeout_s: float = 120.0) -> None:
    """Until the trainer has loaded its model and created its consumer (it serves health before)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        snapshot = json.loads(status(run_dir, "--once", "--json").stdout)
        if snapshot["trainer"].get("state") not in (None, "starting") and any(
                q["stream"] == "TRAJECTORIES" for q in snapshot["queues"]):
            return
        time.sleep(1.0)
    raise AssertionError(f"the trainer did not start consuming: {snapshot}")


def test_one_snapshot_shows_services_engines_versions_queues_and_staleness(launched):
    result = status(launched.run_dir, "--once")
    assert result.returncode == 0, result.stdout + result.stderr
    text = result.stdout
    for name in ("nats", "redis", *SERVICES):
        assert any(line.split()[:1] == [name] and "healthy" in line for line in text.splitlines()), name
    assert any(line.split()[:4] == ["e0", "fleet", "healthy", "0"] for line in text.splitlines()), text
    assert "trainer  v0  step 0" in text
    assert "broker   latest v0" in text
    assert any(line.split()[:1] == ["TRAJECTORIES"] for line in text.splitlines()), text
    assert "staleness  0 versions" in text
    assert "\x1b[" not in text, "no colour codes when the output is not a terminal"


def test_json_snapshot_carries_the_same_figures(launched):
    result = status(launched.run_dir, "--once", "--json")
    assert result.returncode == 0, result.stderr
    snapshot = json.loads(result.stdout)
    assert snapshot["healthy"] is True and snapshot["down"] == {}
    assert {s["name"] for s in snapshot["services"]} == {"nats", "redis", *SERVICES}
    [engine] = snapshot["engines"]
    assert (engine["engine_id"], engine["pool"], engine["policy_version"]) == ("e0", "fleet", 0)
    assert snapshot["trainer"]["version"] == 0 and 0.0 <= snapshot["trainer"]["idle_fraction"] <= 1.0
    [queue] = [q for q in snapshot["queues"] if q["stream"] == "TRAJECTORIES"]
    assert queue["pending"] == 0 and queue["ack_pending"] == 0
    assert snapshot["staleness"] == 0 and snapshot["trajectories"] == 0
    assert snapshot["trajectories_per_s"] is None, "one snapshot has no rate"


def test_the_live_view_refreshes_until_ctrl_c_and_then_exits_cleanly(launched):
    proc = subprocess.Popen([str(BIN / "rlfleet"), "status", "--run-dir", str(launched.run_dir), "--json",
                             "--watch", "--interval", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(8)  # each refresh asks every service; a shared CPU makes that slow
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    frames = [json.loads(frame) for frame in out.split("\n\n(Ctrl-C to quit)\n") if frame.strip()]
    assert len(frames) >= 2
    assert frames[0]["trajectories_per_s"] is None
    assert frames[-1]["trajectories_per_s"] == 0.0 and frames[-1]["steps_per_s"] == 0.0


def test_a_service_that_is_down_is_shown_down_and_the_view_goes_on(launched):
    """Last in the module: it stops the gateway and the trainer of the shared platform."""
    state = PlatformState.load(launched.run_dir)
    for name in ("rollout-gateway", "trainer"):
        record = state.by_name(name)
        assert is_ours(record)
        os.killpg(record.pid, signal.SIGKILL)  # our launch's process group, by its recorded PID
        deadline = time.monotonic() + 10
        while is_ours(record) and time.monotonic() < deadline:
            time.sleep(0.1)
    result = status(launched.run_dir, "--once")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stdout.splitlines()
    for name in ("rollout-gateway", "trainer"):
        assert any(line.split()[:1] == [name] and "down" in line for line in lines), result.stdout
    assert any(line.split()[:1] == ["session-server"] and "healthy" in line for line in lines)
    assert "trainer  down" in result.stdout
    assert "broker   latest v0" in result.stdout, "what still answers is still shown"
    snapshot = json.loads(status(launched.run_dir, "--once", "--json").stdout)
    assert snapshot["healthy"] is False and snapshot["engines"] == [] and snapshot["trainer"] == {}


def test_a_killed_process_comes_back_on_its_own_ports_and_status_counts_the_restart(launched):
    """After the test above: the launcher's supervision starts the gateway and the trainer again
    with their recorded command lines, on the addresses their peers know; status shows the restarts."""
    from rlfleet.cli.launcher import Platform

    platform = Platform.attach(launched.run_dir)
    before = {name: platform.state.by_name(name).address for name in ("rollout-gateway", "trainer")}
    events = platform.restart_dead()
    assert ([e.split()[:2] for e in events]
            == [["rollout-gateway", "restarted"], ["trainer", "restarted"]]), events
    state = PlatformState.load(launched.run_dir)
    for name, address in before.items():
        record = state.by_name(name)
        assert is_ours(record) and record.address == address
        assert record.restarts == 1 and record.last_exit and record.last_restart_unix > 0
    assert platform.restart_dead() == [], "nothing else is down"
    wait_for_trainer(launched.run_dir)
    result = status(launched.run_dir, "--once")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    for name in before:
        assert any(line.split()[:1] == [name] and "healthy" in line and " 1 (last: " in line
                   for line in lines), \
            result.stdout
    assert any(line.split()[:4] == ["e0", "fleet", "healthy", "0"] for line in lines), "the gateway is back"
    snapshot = json.loads(status(launched.run_dir, "--once", "--json").stdout)
    assert {s["name"]: s["restarts"] for s in snapshot["services"]}["trainer"] == 1
