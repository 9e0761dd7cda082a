"""The life of a service process: config, logs, telemetry, start, serve until a signal, stop.

A service's `main` is one line: its config model, and the factory that builds its `App`, named so
that it is imported after the config is parsed (`--help` never imports heavy modules):

    def main() -> None:
        run_service("rlfleet-session-server", SessionServerConfig, "rlfleet.session.app:build")

A process that is not a gRPC service (the CPU engine serves HTTP) goes the same way with
`run_process`: config (defaults < TOML < environment < flags), logs, then its own coroutine, which
reports readiness with `write_ready_file`.

With `--standby` a service's script first imports its app and waits to be promoted
(rlfleet.common.standby): what a supervisor keeps beside a live process to take over at once.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import signal
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import uvloop

from rlfleet.common import standby
from rlfleet.common.config import ConfigError, ProcessConfig, ServiceConfig, load_config
from rlfleet.common.errors import StartupError, Unimplemented
from rlfleet.common.grpc_server import GrpcServer
from rlfleet.common.logs import setup_logging
from rlfleet.common.processes import write_json_atomic
from rlfleet.common.security import set_identity
from rlfleet.common.telemetry import setup_telemetry

log = logging.getLogger(__name__)
C = TypeVar("C", bound=ProcessConfig)
S = TypeVar("S", bound=ServiceConfig)


class App(ABC):
    """One service's logic: connects its peers, registers its servicers, cleans up."""

    @abstractmethod
    async def start(self, server: GrpcServer) -> None:
        """Connects to what the service needs and adds its servicers to `server`."""

    async def stop(self) -> None:
        """Releases connections and background tasks; called once, after the server stopped."""


def write_ready_file(path: str | Path, payload: dict) -> None:
    """Says the process serves: a launcher or test waiting on `path` reads `payload` (atomically
    written, so a reader never sees half a file)."""
    write_json_atomic(path, payload)


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT: what every process serves until."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def app_factory(factory: Callable[[C], App] | str) -> Callable[[C], App]:
    """`factory`, or the one named "module:function", imported only now: a service's entry point
    names its app this way, so `--help` never imports the service."""
    if not isinstance(factory, str):
        return factory
    module, _, function = factory.partition(":")
    return getattr(importlib.import_module(module), function)


async def serve(name: str, config: S, factory: Callable[[S], App] | str) -> None:
    telemetry = setup_telemetry(name, config.telemetry, config.metrics)
    stop = stop_on_signals()
    app = app_factory(factory)(config)
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


def start_process(name: str, config_cls: type[C], argv: list[str] | None = None, log_name: str = "") -> C:
    """What every entry point does first: the config (exit 2 with one line when it is wrong), then
    the logs (`log_name` names the process in them; default `name`)."""
    try:
        config = load_config(config_cls, argv, prog=name)
    except ConfigError as exc:
        print(f"{name}: config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    setup_logging(log_name or name, config.log.level, config.log.format)
    set_identity(name)  # the certificate and token this process presents: its service's
    return config


def run_process(name: str, config_cls: type[C], body: Callable[[C], Coroutine[Any, Any, None]],
                argv: list[str] | None = None) -> None:
    """Entry point of a console script: `start_process`, then `body(config)` on uvloop; exits 1
    with one line when it cannot start."""
    config = start_process(name, config_cls, argv)
    try:
        uvloop.run(body(config))
    except (StartupError, ConfigError) as exc:
        print(f"{name}: cannot start: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


def run_service(name: str, config_cls: type[S], factory: Callable[[S], App] | str,
                argv: list[str] | None = None, warm_up: Callable[[S], None] | None = None,
                promoted: Callable[[float], None] | None = None) -> None:
    """Entry point of a service's console script: `run_process` serving the App `factory` builds
    (a function, or "module:function" to import after the config is parsed). With `--standby`:
    first the factory's module and `warm_up(config)`, then a wait for the promotion, whose
    perf_counter goes to `promoted`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if standby.requested(argv):
        argv = standby.strip_flag(argv)
        at = _stand_by(name, config_cls, factory, argv, warm_up)
        if promoted is not None:
            promoted(at)
    run_process(name, config_cls, lambda config: serve(name, config, factory), argv)


def _stand_by(name: str, config_cls: type[S], factory: Callable[[S], App] | str, argv: list[str],
              warm_up: Callable[[S], None] | None) -> float:
    try:
        config = load_config(config_cls, argv, prog=name)  # for its ready file; read again once promoted
    except ConfigError as exc:
        print(f"{name}: config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None

    def imports() -> None:
        app_factory(factory)
        if warm_up is not None:
            warm_up(config)

    return standby.wait_for_promotion(config.ready_file, imports)


def placeholder_servicer(base: type, service_full_name: str, issue: str) -> object:
    """A servicer whose every RPC answers UNIMPLEMENTED saying which issue will implement it."""
    def make(method: str):
        async def rpc(self, request, context):
            raise Unimplemented(f"{service_full_name}/{method} is not implemented yet ({issue})")
        return rpc

    methods = {name: make(name) for name in dir(base) if not name.startswith("_")}
    return type(f"Placeholder{base.__name__}", (base,), methods)()
