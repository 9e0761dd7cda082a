"""The life of a service process: config, logs, telemetry, start, serve until a signal, stop.

A service's `main` is three lines: its config model, and a factory that builds its `App` after the
config is parsed (so `--help` never imports heavy modules):

    def main() -> None:
        run_service("rlfleet-session-server", SessionServerConfig, build_app)
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from rlfleet.common.config import ConfigError, ServiceConfig, load_config
from rlfleet.common.errors import StartupError
from rlfleet.common.grpc_server import GrpcServer

log = logging.getLogger(__name__)
C = TypeVar("C", bound=ServiceConfig)


class App(ABC):
    """One service's logic: connects its peers, registers its servicers, cleans up."""

    @abstractmethod
    async def start(self, server: GrpcServer) -> None:
        """Connects to what the service needs and adds its servicers to `server`."""

    async def stop(self) -> None:
        """Releases connections and background tasks; called once, after the server stopped."""


def write_ready_file(path: str, payload: dict) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".tmp")
    tmp.write_text(json.dumps(payload))
    tmp.rename(target)  # atomic, so a reader never sees half a file


async def serve(name: str, config: ServiceConfig, factory: Callable[[ServiceConfig], App]) -> None:
    from rlfleet.common.telemetry import setup_telemetry

    telemetry = setup_telemetry(name, config.telemetry, config.metrics)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    app = factory(config)
    server = GrpcServer(config.grpc)
    try:
        # A signal while connecting to peers ends the start instead of waiting for it.
        starting = asyncio.ensure_future(app.start(server))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            log.info("stopped while starting")
            return
        stopping.cancel()
        starting.result()
        port = await server.start()
        info = {"service": name, "pid": os.getpid(), "grpc_port": port,
                "grpc_address": f"{config.grpc.host}:{port}", "metrics_port": telemetry.metrics_port}
        if config.ready_file:
            write_ready_file(config.ready_file, info)
        log.info("serving", extra=info)
        await stop.wait()
        log.info("stopping")
        await server.stop()
    finally:
        await app.stop()
        telemetry.shutdown(config.telemetry.export_timeout_s)
    log.info("stopped")


def run_service(name: str, config_cls: type[C], factory: Callable[[C], App], argv: list[str] | None = None) -> None:
    """Entry point of a service's console script; exits non-zero with one line on bad config or start-up."""
    try:
        config = load_config(config_cls, argv, prog=name)
    except ConfigError as exc:
        print(f"{name}: config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    from rlfleet.common.logs import setup_logging

    setup_logging(name, config.log.level, config.log.format)
    import uvloop

    try:
        uvloop.run(serve(name, config, factory))
    except (StartupError, ConfigError) as exc:
        print(f"{name}: cannot start: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


class PeersApp(App):
    """An app that connects to NATS (ensuring the streams) and/or Redis before serving.

    Subclasses set `uses_nats`/`uses_redis` and read `self.nc`, `self.js`, `self.redis`.
    """

    uses_nats = False
    uses_redis = False

    def __init__(self, config: ServiceConfig, name: str) -> None:
        self.config = config
        self.name = name
        self.nc = None
        self.js = None
        self.redis = None

    async def connect(self) -> None:
        if self.uses_redis:
            from rlfleet.common.redis_store import connect_redis

            self.redis = await connect_redis(self.config.redis)  # type: ignore[attr-defined]
        if self.uses_nats:
            from rlfleet.common.streams import connect_nats, ensure_streams

            self.nc = await connect_nats(self.config.nats, self.name)  # type: ignore[attr-defined]
            self.js = self.nc.jetstream()
            await ensure_streams(self.js)

    async def stop(self) -> None:
        if self.nc is not None:
            try:
                await asyncio.wait_for(self.nc.drain(), 3.0)
            except (TimeoutError, Exception):  # NATS gone already: nothing left to flush
                await self.nc.close()
        if self.redis is not None:
            await self.redis.aclose()


def placeholder_servicer(base: type, service_full_name: str, issue: str) -> object:
    """A servicer whose every RPC answers UNIMPLEMENTED saying which issue will implement it."""
    from rlfleet.common.errors import Unimplemented

    def make(method: str):
        async def rpc(self, request, context):
            raise Unimplemented(f"{service_full_name}/{method} is not implemented yet ({issue})")
        return rpc

    methods = {name: make(name) for name in dir(base) if not name.startswith("_")}
    return type(f"Placeholder{base.__name__}", (base,), methods)()
