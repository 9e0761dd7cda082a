"""The rollout-gateway service process."""

from __future__ import annotations

from rlfleet.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from rlfleet.common.grpc_server import GrpcServer
from rlfleet.common.service import PeersApp, placeholder_servicer
from rlfleet.gateway.config import RolloutGatewayConfig

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name


class RolloutGatewayApp(PeersApp):
    uses_nats = False
    uses_redis = True

    async def start(self, server: GrpcServer) -> None:
        await self.connect()
        servicer = placeholder_servicer(gateway_pb2_grpc.GatewayServiceServicer, SERVICE_NAME, "issue #3: rollout tier")
        server.add(gateway_pb2_grpc.add_GatewayServiceServicer_to_server, servicer, SERVICE_NAME)


def build(config: RolloutGatewayConfig) -> RolloutGatewayApp:
    return RolloutGatewayApp(config, "rlfleet-gateway")
