"""The controller service process: the RunControl component and its gRPC servicer; the run it was
driving when it stopped is continued on start."""

from __future__ import annotations

import logging
from pathlib import Path

from rlfleet.api.controller.v1 import controller_pb2, controller_pb2_grpc
from rlfleet.cli.launcher import PlatformState
from rlfleet.cli.rl_loop import PlatformView
from rlfleet.common.config import require
from rlfleet.common.errors import StartupError
from rlfleet.common.grpc_server import GrpcServer
from rlfleet.common.service import App
from rlfleet.controller.config import ControllerConfig
from rlfleet.controller.metrics import ControllerMetrics
from rlfleet.controller.run_control import RunControl
from rlfleet.controller.servicer import RunControlServicer

SERVICE_NAME = controller_pb2.DESCRIPTOR.services_by_name["RunControl"].full_name
log = logging.getLogger(__name__)


class ControllerApp(App):
    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.control: RunControl | None = None

    async def start(self, server: GrpcServer) -> None:
        require(self.config.run_dir, "run_dir")
        self.control = RunControl(Path(self.config.run_dir), self.config.run_id, platform_view(self.config),
                                  self.config.keep_lines, ControllerMetrics())
        server.add(controller_pb2_grpc.add_RunControlServicer_to_server, RunControlServicer(self.control),
                   SERVICE_NAME)
        if self.config.resume_on_start and self.control.resume_on_start():
            log.info("resumed the run this controller was driving", extra={"run_dir": self.config.run_dir})
        elif self.config.start_run:
            self.control.start_configured(self.config.start_run)

    async def stop(self) -> None:
        if self.control is not None:
            await self.control.close()


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
                        sandbox=config.sandbox_address, trainer_metrics_url=config.trainer_metrics_url, pids=pids)


def build(config: ControllerConfig) -> ControllerApp:
    return ControllerApp(config)
