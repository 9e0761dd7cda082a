"""Test helpers: a service's console script as a real process, and a sandbox manager on its own root.

Used by this service's integration tests and by the services that call it (the verifier).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

BIN = Path(sys.executable).parent


@dataclass
class ServiceProcess:
    """One service process started from its console script; stopped (only it, by PID) on `stop()`."""

    name: str
    proc: subprocess.Popen
    log: Path
    info: dict

    @property
    def address(self) -> str:
        return self.info["grpc_address"]

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.info['metrics_port']}/metrics"

    @classmethod
    def start(cls, script: str, args: list[str], workdir: Path, timeout_s: float = 30.0) -> ServiceProcess:
        workdir.mkdir(parents=True, exist_ok=True)
        ready = workdir / f"{script}.ready.json"
        ready.unlink(missing_ok=True)
        log = workdir / f"{script}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen([str(BIN / script), *args, "--ready-file", str(ready)],
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                cls(script, proc, log, {}).stop()
                raise RuntimeError(f"{script} did not start (exit {proc.returncode}):\n{log.read_text()[-3000:]}")
            time.sleep(0.05)
        return cls(script, proc, log, json.loads(ready.read_text()))

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to clean up (a crash)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout_s: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def sandbox_manager_args(redis_url: str, run_id: str, workdir: Path, *extra: str) -> list[str]:
    """A manager on `workdir/sandboxes` with a uid range of its own (derived from the path) and no warm pool."""
    uid_base = 700_000 + (zlib.crc32(str(workdir).encode()) % 5000) * 64
    return ["--redis.url", redis_url, "--run-id", run_id, "--root", str(workdir / "sandboxes"),
            "--uid-base", str(uid_base), "--max-sandboxes", "64", "--warm-pool-size", "0", *extra]


def start_sandbox_manager(redis_url: str, run_id: str, workdir: Path, *extra: str) -> ServiceProcess:
    return ServiceProcess.start("rlfleet-sandbox-manager", sandbox_manager_args(redis_url, run_id, workdir, *extra),
                                workdir)
