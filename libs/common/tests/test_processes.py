"""The one process harness: start a child, wait until it is ready, stop it by PID; free ports; eventually."""

from __future__ import annotations

import json
import sys
import time

import pytest

from rlfleet.common.processes import (
    ChildProcess,
    ProcessNotReady,
    ServiceProcess,
    eventually,
    free_port,
    port_open,
    wait_until,
)

# A stand-in service: reads its --config file, writes its ready file, serves until SIGTERM.
SERVICE = """
import json, signal, sys, time
args = sys.argv[1:]
config = json.load(open(args[args.index("--config") + 1]))
extra = args[args.index("--config") + 2:args.index("--ready-file")]
print("starting", flush=True)
json.dump({"pid": __import__("os").getpid(), "config": config, "flags": extra, "grpc_address": "127.0.0.1:1"},
          open(args[args.index("--ready-file") + 1], "w"))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    time.sleep(0.05)
"""


def test_a_service_process_gets_its_config_file_and_flags_and_is_ready_when_it_says_so(tmp_path):
    service = ServiceProcess([sys.executable, "-c", SERVICE], tmp_path, "--extra", 1,
                             config={"redis.url": "redis://x", "log": {"format": "text"}}).start(30)
    try:
        assert service.info["pid"] == service.pid and service.address == "127.0.0.1:1"
        assert service.info["config"] == {"redis": {"url": "redis://x"}, "log": {"format": "text"}}
        assert service.info["flags"] == ["--extra", "1"]
        assert "starting" in service.log()
    finally:
        assert service.stop() == 0
    assert service.returncode == 0


def test_a_child_that_exits_before_it_is_ready_fails_with_the_end_of_its_log(tmp_path):
    crash = ServiceProcess([sys.executable, "-c", "print('bad config: no url'); raise SystemExit(2)"],
                           tmp_path)
    with pytest.raises(ProcessNotReady, match=r"exited with code 2: \(see .*\)\nbad config: no url"):
        crash.start(30)


def test_a_child_that_is_not_ready_in_time_is_stopped(tmp_path):
    slow = ServiceProcess([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path, name="slow")
    started = time.monotonic()
    with pytest.raises(ProcessNotReady, match="slow was not ready after 1 s"):
        slow.start(1.0)
    assert slow.returncode is not None and time.monotonic() - started < 30


def test_one_line_failures_say_the_last_log_line_for_the_launcher(tmp_path):
    script = "import json; print(json.dumps({'msg': 'port in use'})); exit(1)"
    child = ChildProcess([sys.executable, "-c", script], tmp_path / "c.log", name="svc", log_lines=1).spawn()
    with pytest.raises(ProcessNotReady, match=r"svc exited with code 1: port in use \(see .*c.log\)"):
        child.wait_for_file(tmp_path / "never.json", 30)


def test_kill_is_a_crash_and_stop_is_sigterm(tmp_path):
    child = ChildProcess([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "c.log").spawn()
    child.kill()
    assert child.returncode == -9
    assert child.stop() == -9  # already gone: nothing more is signalled


def test_wait_until_returns_the_first_truthy_value_or_says_what_it_waited_for():
    values = iter([None, 0, {"ready": True}])
    assert wait_until(lambda: next(values), 5, every_s=0.01) == {"ready": True}
    with pytest.raises(ProcessNotReady, match="the moon was not ready after 0 s"):
        wait_until(lambda: False, 0.05, "the moon", every_s=0.01)


async def test_eventually_takes_plain_and_async_predicates():
    count = {"n": 0}

    def plain():
        count["n"] += 1
        return count["n"] >= 3 and "done"

    async def later():
        count["n"] += 1
        return count["n"] >= 5 and count["n"]

    assert await eventually(plain, within_s=5, every_s=0.01) == "done"
    assert await eventually(later, within_s=5, every_s=0.01) == 5
    with pytest.raises(AssertionError, match="not reached within 0.05s: nothing"):
        await eventually(lambda: None, within_s=0.05, every_s=0.01, message="nothing")


def test_a_free_port_is_free():
    port = free_port()
    assert not port_open(port)


def test_the_config_file_is_json_with_paths_as_strings(tmp_path):
    service = ServiceProcess([sys.executable, "-c", "pass"], tmp_path, config={"root": tmp_path / "x"})
    service.spawn()
    service.stop()
    assert json.loads(service.config_file.read_text()) == {"root": str(tmp_path / "x")}
