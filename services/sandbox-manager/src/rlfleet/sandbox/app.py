"""The sandbox-manager service process."""

from __future__ import annotations

from rlfleet.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from rlfleet.common.grpc_server import GrpcServer
from rlfleet.common.service import PeersApp, placeholder_servicer
from rlfleet.sandbox.config import SandboxManagerConfig

SERVICE_NAME = sandbox_pb2.DESCRIPTOR.services_by_name["SandboxService"].full_name


class SandboxManagerApp(PeersApp):
    uses_nats = False
    uses_redis = True

    async def start(self, server: GrpcServer) -> None:
        await self.connect()
        servicer = placeholder_servicer(sandbox_pb2_grpc.SandboxServiceServicer, SERVICE_NAME, "issue #4: environments")
        server.add(sandbox_pb2_grpc.add_SandboxServiceServicer_to_server, servicer, SERVICE_NAME)


def build(config: SandboxManagerConfig) -> SandboxManagerApp:
    return SandboxManagerApp(config, "rlfleet-sandbox-manager")
