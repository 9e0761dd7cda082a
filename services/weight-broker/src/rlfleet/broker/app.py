"""The weight-broker service process."""

from __future__ import annotations

from rlfleet.api.broker.v1 import broker_pb2, broker_pb2_grpc
from rlfleet.broker.config import WeightBrokerConfig
from rlfleet.common.grpc_server import GrpcServer
from rlfleet.common.service import PeersApp, placeholder_servicer

SERVICE_NAME = broker_pb2.DESCRIPTOR.services_by_name["BrokerService"].full_name


class WeightBrokerApp(PeersApp):
    uses_nats = True
    uses_redis = True

    async def start(self, server: GrpcServer) -> None:
        await self.connect()
        servicer = placeholder_servicer(broker_pb2_grpc.BrokerServiceServicer, SERVICE_NAME, "issue #6: weight broker")
        server.add(broker_pb2_grpc.add_BrokerServiceServicer_to_server, servicer, SERVICE_NAME)


def build(config: WeightBrokerConfig) -> WeightBrokerApp:
    return WeightBrokerApp(config, "rlfleet-weight-broker")
