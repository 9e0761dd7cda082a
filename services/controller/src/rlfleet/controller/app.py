"""The controller service process: the run's state store (JetStream KV), the RunControl component
and its gRPC servicer; the run a controller was driving when it stopped is continued on start."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

from rlfleet.api.controller.v1 import controller_pb2, controller_pb2_grpc
from rlfleet.cli.launcher import PlatformState
from rlfleet.cli.rl_loop import PlatformView
from rlfleet.common.config import require
from rlfleet.common.errors import StartupError
from rlfleet.common.grpc_server import GrpcServer
from rlfleet.common.service import App
from rlfleet.common.streams import connect_nats
from rlfleet.controller.config import ControllerConfig
from rlfleet.controller.metrics import ControllerMetrics
from rlfleet.controller.run_control import RunControl
from rlfleet.controller.servicer import RunControlServicer
from rlfleet.controller.state_store import RunStore

SERVICE_NAME = controller_pb2.DESCRIPTOR.services_by_name["RunControl"].full_name
log = logging.getLogger(__name__)


class ControllerApp(App):
    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.control: RunControl | None = None
        self.nc: Any = None  # the store's NATS connection (the loop has its own, per run)
        self.beginning: asyncio.Task | None = None

    async def start(self, server: GrpcServer) -> None:
        config = self.config
        require(config.run_dir, "run_dir")
        platform = platform_view(config)
        metrics = ControllerMetrics()
        self.nc = await connect_nats(config.nats, "rlfleet-controller-state")
        run_dir = Path(config.run_dir)
        store = await RunStore.open(self.nc.jetstream(), config.run_id, config.state, run_dir, metrics)
        self.control = RunControl(run_dir, config.run_id, store, platform, config.keep_lines, metrics)
        server.add(controller_pb2_grpc.add_RunControlServicer_to_server, RunControlServicer(self.control),
                   SERVICE_NAME)
        configured = self.control.configured_run(config.start_run) if config.start_run else None
        # In the background: a run another controller holds is waited for while this one serves.
        self.beginning = asyncio.create_task(self.control.begin(config.resume_on_start, configured),
                                             name="the run on start")

    async def stop(self) -> None:
        if self.beginning is not None:
            self.beginning.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.beginning
        if self.control is not None:
            await self.control.close()
        if self.nc is not None:
            await self.nc.close()


def platform_view(config: ControllerConfig) -> PlatformView:
    """The platform as the config gives it; the processes to sample from a local launch record, if
    there is one (compose and Kubernetes have none: the report shows this process's CPU alone)."""
    for name in ("nats.url", "gateway_address", "trainer_address", "broker_address",
                 "verifier_address", "session_address", "sandbox_address"):
        section, _, key = name.rpartition(".")
        require(getattr(getattr(config, section) if section else config, key), name)
    try:
        pids = tuple(p.pid for p in PlatformState.load(config.run_dir).processes if p.pid > 0)
    except StartupError:
        pids = ()
    return PlatformView(nats=config.nats, worker_nats=config.nats, gateway=config.gateway_address,
                        trainer=config.trainer_address, broker=config.broker_address,
                        verifier=config.verifier_address, session=config.session_address,
                        sandbox=config.sandbox_address, trainer_metrics_url=config.trainer_metrics_url,
                        pids=pids)


def build(config: ControllerConfig) -> ControllerApp:
    return ControllerApp(config)
