"""The trainer service process."""

from __future__ import annotations

from rlfleet.api.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from rlfleet.common.grpc_server import GrpcServer
from rlfleet.common.service import PeersApp, placeholder_servicer
from rlfleet.trainer.service_config import TrainerConfig

SERVICE_NAME = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name


class TrainerApp(PeersApp):
    uses_nats = True
    uses_redis = False

    async def start(self, server: GrpcServer) -> None:
        await self.connect()
        servicer = placeholder_servicer(trainer_pb2_grpc.TrainerServiceServicer, SERVICE_NAME, "issue #5: trainer")
        server.add(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, servicer, SERVICE_NAME)


def build(config: TrainerConfig) -> TrainerApp:
    return TrainerApp(config, "rlfleet-trainer")
