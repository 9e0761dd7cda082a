"""Test helpers for the rollout tier: CPU engines, a gateway and session servers as processes, for one run.

    stack = Rollout(workdir, nats_url, redis_url, model, run_id).start(engines=2)
    stack.session.address     # host:port of the session server
    stack.gateway.kill()      # SIGKILL (a crash); stop() is SIGTERM, then SIGKILL after a grace period

Every process is started through the one harness (`rlfleet.common.processes.ServiceProcess`), with
its config in a file (`--config`), and stopped by PID.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nats

from rlfleet.api.common.v1 import common_pb2
from rlfleet.common.processes import ServiceProcess, free_port
from rlfleet.common.security import client_ssl_context
from rlfleet.common.streams import ensure_consumer


def gateway_config(redis_url: str, run_id: str, engines: list[tuple[str, str]], **settings) -> dict:
    """The config of an `rlfleet-gateway` with the given engines [(engine_id, url)] (metrics off
    unless asked for: tests need no endpoints)."""
    specs = [{"engine_id": engine_id, "url": url} for engine_id, url in engines]
    return {"redis.url": redis_url, "run_id": run_id, "engines": specs, "log.format": "text",
            "metrics.enabled": False, **settings}


def session_server_config(nats_url: str, redis_url: str, run_id: str, gateway_address: str,
                          tokenizer_path: str, **settings) -> dict:
    return {"nats.url": nats_url, "redis.url": redis_url, "run_id": run_id,
            "gateway_address": gateway_address, "tokenizer_path": str(tokenizer_path), "log.format": "text",
            "metrics.enabled": False, **settings}


class Rollout:
    """The rollout tier as processes: CPU engines, a gateway and a session server, for one run.

    NATS and Redis are the caller's (the shared test fixtures); everything started here is stopped
    by PID in `stop()`.
    """

    def __init__(self, workdir: Path, nats_url: str, redis_url: str, model: Path, run_id: str) -> None:
        self.workdir, self.nats_url, self.redis_url, self.model, self.run_id = (
            workdir, nats_url, redis_url, model, run_id)
        self.engines: dict[str, ServiceProcess] = {}
        self.gateway: ServiceProcess | None = None
        self.sessions: list[ServiceProcess] = []

    @property
    def session(self) -> ServiceProcess:
        """The latest session server (a restart appends a new one)."""
        return self.sessions[-1]

    def start(self, engines: int = 1, gateway: dict | None = None, session: dict | None = None) -> Rollout:
        try:
            names = [f"e{i}" for i in range(engines)]
            with ThreadPoolExecutor(max(1, engines)) as pool:  # engines load their model in parallel
                started = pool.map(self._start_engine, names)
                self.engines = dict(zip(names, started, strict=True))
            port = free_port()
            urls = [(n, e.url) for n, e in self.engines.items()]
            settings = {"grpc.port": port, **(gateway or {})}
            config = gateway_config(self.redis_url, self.run_id, urls, **settings)
            self.gateway = ServiceProcess("rlfleet-gateway", self.workdir, config=config).spawn()
            self.start_session_server(f"127.0.0.1:{port}", wait=False, **(session or {}))
            self.gateway.wait_ready()
            self.session.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_engine(self, name: str) -> ServiceProcess:
        config = {"model_path": str(self.model), "engine_id": name, "weight_version": "0", "torch_threads": 1,
                  "weight_store_root": str(self.workdir / "weights")}
        return ServiceProcess("rlfleet-cpu-engine", self.workdir / name, config=config).start(90.0)

    def start_session_server(self, gateway_address: str | None = None, wait: bool = True,
                             **config) -> ServiceProcess:
        if gateway_address:
            address = gateway_address
        elif self.gateway is not None:
            address = self.gateway.address
        else:
            raise RuntimeError("no gateway for the session server: start() the rollout first, or pass one")
        process = ServiceProcess("rlfleet-session-server", self.workdir, config=session_server_config(
            self.nats_url, self.redis_url, self.run_id, address, str(self.model), **config)).spawn()
        self.sessions.append(process)
        return process.wait_ready() if wait else process

    def stop(self) -> None:
        for process in [*reversed(self.sessions), self.gateway, *self.engines.values()]:
            if process is not None:
                process.stop()


async def read_trajectories(nats_url: str, run_id: str, wait_s: float = 1.0) -> list:
    """Every trajectory published for `run_id` so far, read with a throwaway consumer."""
    nc = await nats.connect(nats_url, tls=client_ssl_context() if nats_url.startswith("tls://") else None)
    durable = f"test-{uuid.uuid4().hex[:12]}"
    try:
        js = nc.jetstream()
        await ensure_consumer(js, "TRAJECTORIES", durable, run_id)
        subscription = await js.pull_subscribe_bind(durable, "TRAJECTORIES")
        found = []
        while True:
            try:
                batch = await subscription.fetch(256, timeout=wait_s)
            except TimeoutError:  # nats-py 2.16 also raises the bare one when its deadline passed early
                break
            for message in batch:
                found.append(common_pb2.Trajectory.FromString(message.data))
                await message.ack()
        await js.delete_consumer("TRAJECTORIES", durable)
        return found
    finally:
        await nc.close()
