"""The session-server service process."""

from __future__ import annotations

from rlfleet.api.session.v1 import session_pb2, session_pb2_grpc
from rlfleet.common.grpc_server import GrpcServer
from rlfleet.common.service import PeersApp, placeholder_servicer
from rlfleet.session.config import SessionServerConfig

SERVICE_NAME = session_pb2.DESCRIPTOR.services_by_name["SessionService"].full_name


class SessionServerApp(PeersApp):
    uses_nats = True
    uses_redis = True

    async def start(self, server: GrpcServer) -> None:
        await self.connect()
        servicer = placeholder_servicer(session_pb2_grpc.SessionServiceServicer, SERVICE_NAME, "issue #3: rollout tier")
        server.add(session_pb2_grpc.add_SessionServiceServicer_to_server, servicer, SERVICE_NAME)


def build(config: SessionServerConfig) -> SessionServerApp:
    return SessionServerApp(config, "rlfleet-session-server")
