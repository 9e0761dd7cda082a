"""Test helpers: a `rlfleet-weight-broker` process on free ports (stopped by PID), and small waits."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rlfleet.api.common.v1 import common_pb2


class ServiceProcess:
    """An rlfleet service's console script with `--set key=value` overrides; `address` once ready."""

    script = ""
    defaults: dict[str, Any] = {}

    def __init__(self, workdir: Path, script: str = "", **settings: Any) -> None:
        self.workdir = Path(workdir)
        self.script = script or self.script
        self.settings = {"log.format": "text", **self.defaults, **settings}
        self.process: subprocess.Popen | None = None
        self.address = ""
        self.metrics_port = 0

    def start(self, timeout_s: float = 30.0) -> ServiceProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        ready = self.workdir / f"{self.script}-{time.monotonic_ns()}.ready.json"
        args = [str(Path(sys.executable).parent / self.script), "--ready-file", str(ready)]
        for key, value in self.settings.items():
            args += ["--set", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
        self.log_path = ready.with_suffix(".log")
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.script} did not start:\n{self.log_path.read_text()[-4000:]}")
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        self.address, self.metrics_port = info["grpc_address"], info["metrics_port"]
        return self

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.kill(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=15)

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()


class BrokerProcess(ServiceProcess):
    """`rlfleet-weight-broker`, reconciling every half second."""

    script = "rlfleet-weight-broker"
    defaults = {"reconcile_interval_s": 0.5}


def policy_version(manifest: dict[str, Any], **extra: Any) -> common_pb2.PolicyVersion:
    """The PolicyVersion a trainer announces for a store manifest (`DirectoryWeightStore.write_version`)."""
    full = manifest["full_version"]
    return common_pb2.PolicyVersion(
        schema_version=common_pb2.SCHEMA_VERSION_1,
        run_id=manifest["run_id"],
        version=manifest["version"],
        parent_version=extra.pop("parent_version", manifest["version"] - 1),
        format=common_pb2.WEIGHT_FORMAT_FULL if manifest["kind"] == "full" else common_pb2.WEIGHT_FORMAT_DELTA,
        base_version=manifest["base_version"] if manifest["base_version"] is not None else -1,
        uri=manifest["uri"],
        full_uri=Path(manifest["path"]).with_name(f"v{full:06d}").as_uri() if full is not None else "",
        checksum=manifest["checksum"],
        num_bytes=manifest["bytes"],
        created_unix_ms=int(time.time() * 1000),
        served_dtype="bf16",
        **extra,
    )


async def eventually(predicate, within_s: float = 20.0, every_s: float = 0.05, message: str = "") -> Any:
    """Polls the async `predicate` until it returns something truthy, which is returned."""
    deadline = time.monotonic() + within_s
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {within_s}s: {message or predicate}")
        await asyncio.sleep(every_s)
