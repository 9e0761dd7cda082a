"""Test helpers for the rollout tier: service processes on free ports, started and stopped by PID.

    gateway = ServiceProcess("rlfleet-gateway", workdir, "--redis.url", redis_url, "--engines", json).start()
    gateway.address       # host:port of its gRPC server
    gateway.kill()        # SIGKILL (a crash); gateway.stop() is SIGTERM, then SIGKILL after a grace period
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent


class ServiceProcess:
    def __init__(self, script: str, workdir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.script = script
        self.workdir = Path(workdir)
        self.args = [str(a) for a in args]
        self.env = env
        self.process: subprocess.Popen | None = None
        self.info: dict = {}

    @property
    def address(self) -> str:
        return self.info["grpc_address"]

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def spawn(self) -> ServiceProcess:
        """Starts the process without waiting for it (see `wait_ready`), so several can start at once."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        stamp = time.monotonic_ns()
        self.ready_file = self.workdir / f"{self.script}-{stamp}.ready.json"
        self.log_path = self.workdir / f"{self.script}-{stamp}.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(self.env or {})}
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [str(BIN / self.script), *self.args, "--ready-file", str(self.ready_file), "--log.format", "text"],
                stdout=log, stderr=subprocess.STDOUT, env=env)
        return self

    def wait_ready(self, timeout_s: float = 60.0) -> ServiceProcess:
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while not self.ready_file.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.script} exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{self.script} not ready after {timeout_s}s:\n{self.log()[-4000:]}")
            time.sleep(0.05)
        self.info = json.loads(self.ready_file.read_text())
        return self

    def start(self, timeout_s: float = 60.0) -> ServiceProcess:
        return self.spawn().wait_ready(timeout_s)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, grace_s: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.kill(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL: the process dies as in a crash, with no chance to clean up."""
        if self.process is None or self.process.poll() is not None:
            return
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=15)


def gateway_args(redis_url: str, run_id: str, engines: list[tuple[str, str]], **config) -> list[str]:
    """Command-line arguments for `rlfleet-gateway` with the given engines [(engine_id, url)]."""
    specs = [{"engine_id": engine_id, "url": url} for engine_id, url in engines]
    args = ["--redis.url", redis_url, "--run-id", run_id, "--engines", json.dumps(specs)]
    return args + _settings({"metrics.enabled": False, **config})


def session_server_args(nats_url: str, redis_url: str, run_id: str, gateway_address: str, tokenizer_path: str,
                        **config) -> list[str]:
    args = ["--nats.url", nats_url, "--redis.url", redis_url, "--run-id", run_id, "--gateway-address",
            gateway_address, "--tokenizer-path", str(tokenizer_path)]
    return args + _settings({"metrics.enabled": False, **config})


def _settings(config: dict) -> list[str]:
    """`--set key=value` for each entry (metrics off unless asked for: tests need no endpoints)."""
    args = []
    for key, value in config.items():
        args += ["--set", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    return args


_built_models: dict[tuple[Path, int], Path] = {}


def tiny_model(root: Path, seed: int = 0) -> Path:
    """The engine's tiny test model, built once per test process under `root` (torch is imported here,
    in the test process, never in a service)."""
    from rlfleet.engine.testing import build_tiny_model

    key = (Path(root), seed)
    if key not in _built_models:
        _built_models[key] = build_tiny_model(Path(root) / f"tiny-seed{seed}", seed=seed)
    return _built_models[key]


class Rollout:
    """The rollout tier as processes: CPU engines, a gateway and a session server, for one run.

    NATS and Redis are the caller's (the shared test fixtures); everything started here is stopped
    by PID in `stop()`.
    """

    def __init__(self, workdir: Path, nats_url: str, redis_url: str, model: Path, run_id: str) -> None:
        self.workdir, self.nats_url, self.redis_url, self.model, self.run_id = workdir, nats_url, redis_url, model, run_id
        self.engines: dict = {}
        self.gateway: ServiceProcess | None = None
        self.sessions: list[ServiceProcess] = []

    @property
    def session(self) -> ServiceProcess:
        """The latest session server (a restart appends a new one)."""
        return self.sessions[-1]

    def start(self, engines: int = 1, gateway: dict | None = None, session: dict | None = None) -> Rollout:
        from concurrent.futures import ThreadPoolExecutor

        from rlfleet.engine.testing import EngineProcess

        try:
            names = [f"e{i}" for i in range(engines)]
            with ThreadPoolExecutor(max(1, engines)) as pool:  # engines load their model in parallel
                started = pool.map(lambda n: EngineProcess(self.model, self.workdir / n, weight_version="0",
                                                            engine_id=n).start(), names)
                self.engines = dict(zip(names, started, strict=True))
            port = _free_port()
            self.gateway = ServiceProcess(
                "rlfleet-gateway", self.workdir,
                *gateway_args(self.redis_url, self.run_id, [(n, e.url) for n, e in self.engines.items()],
                              **{"grpc.port": port, **(gateway or {})})).spawn()
            self.start_session_server(f"127.0.0.1:{port}", wait=False, **(session or {}))
            self.gateway.wait_ready()
            self.session.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def start_session_server(self, gateway_address: str | None = None, wait: bool = True, **config) -> ServiceProcess:
        address = gateway_address or self.gateway.address
        process = ServiceProcess("rlfleet-session-server", self.workdir, *session_server_args(
            self.nats_url, self.redis_url, self.run_id, address, str(self.model), **config)).spawn()
        self.sessions.append(process)
        return process.wait_ready() if wait else process

    def stop(self) -> None:
        for process in [*reversed(self.sessions), self.gateway, *self.engines.values()]:
            if process is not None:
                process.stop()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def read_trajectories(nats_url: str, run_id: str, wait_s: float = 1.0) -> list:
    """Every trajectory published for `run_id` so far, read with a throwaway consumer."""
    import uuid

    import nats
    from nats.errors import TimeoutError as NatsTimeout

    from rlfleet.api.common.v1 import common_pb2
    from rlfleet.common.streams import ensure_consumer

    nc = await nats.connect(nats_url)
    durable = f"test-{uuid.uuid4().hex[:12]}"
    try:
        js = nc.jetstream()
        await ensure_consumer(js, "TRAJECTORIES", durable, run_id)
        subscription = await js.pull_subscribe_bind(durable, "TRAJECTORIES")
        found = []
        while True:
            try:
                batch = await subscription.fetch(256, timeout=wait_s)
            except NatsTimeout:
                break
            for message in batch:
                found.append(common_pb2.Trajectory.FromString(message.data))
                await message.ack()
        await js.delete_consumer("TRAJECTORIES", durable)
        return found
    finally:
        await nc.close()
