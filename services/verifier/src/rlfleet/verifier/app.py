"""The verifier service process."""

from __future__ import annotations

from rlfleet.api.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from rlfleet.common.grpc_server import GrpcServer
from rlfleet.common.service import PeersApp, placeholder_servicer
from rlfleet.verifier.config import VerifierConfig

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["VerifierService"].full_name


class VerifierApp(PeersApp):
    uses_nats = False
    uses_redis = True

    async def start(self, server: GrpcServer) -> None:
        await self.connect()
        servicer = placeholder_servicer(verifier_pb2_grpc.VerifierServiceServicer, SERVICE_NAME, "issue #4: environments")
        server.add(verifier_pb2_grpc.add_VerifierServiceServicer_to_server, servicer, SERVICE_NAME)


def build(config: VerifierConfig) -> VerifierApp:
    return VerifierApp(config, "rlfleet-verifier")
