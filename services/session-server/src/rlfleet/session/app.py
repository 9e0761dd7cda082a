"""The session-server service process: tokenizer and template, Redis state, the gateway, the stream."""

from __future__ import annotations

from rlfleet.api.session.v1 import session_pb2, session_pb2_grpc
from rlfleet.common.config import require
from rlfleet.common.grpc_server import GrpcServer
from rlfleet.common.peers import PeersApp
from rlfleet.session.closing import Closer
from rlfleet.session.config import SessionServerConfig
from rlfleet.session.gateway_client import GatewayClient
from rlfleet.session.inputs import Inputs, Limits
from rlfleet.session.metrics import SessionMetrics
from rlfleet.session.publisher import TrajectoryPublisher
from rlfleet.session.servicer import SessionServicer
from rlfleet.session.store import SessionStore
from rlfleet.session.text import Tokenizer, load_chat_renderer, model_context_length

SERVICE_NAME = session_pb2.DESCRIPTOR.services_by_name["SessionService"].full_name


class SessionServerApp(PeersApp):
    uses_nats = True
    uses_redis = True
    config: SessionServerConfig

    async def start(self, server: GrpcServer) -> None:
        config = self.config
        await self.connect()
        tokenizer_path = require(config.tokenizer_path, "tokenizer_path")
        gateway_address = require(config.gateway_address, "gateway_address")
        tokenizer = Tokenizer(tokenizer_path)
        renderer = load_chat_renderer(tokenizer_path, config.chat_template)
        limits = Limits(context_length=config.context_length or model_context_length(tokenizer_path),
                        default_budget=config.max_total_tokens, max_text_chars=config.max_text_chars,
                        max_metadata_bytes=config.max_metadata_bytes)
        metrics = SessionMetrics()
        store = SessionStore(self.redis, config.run_id, config.session_ttl_s, config.max_open_sessions)
        self.gateway = GatewayClient(gateway_address, config.gateway_timeout_s)
        publisher = TrajectoryPublisher(self.js, config.run_id, config.publish_timeout_s)
        closer = Closer(store, self.redis, publisher, self.gateway, metrics)
        servicer = SessionServicer(config.run_id, store, Inputs(tokenizer, renderer, limits), self.gateway, closer,
                                   metrics, turn_lease_s=config.gateway_timeout_s + 5.0)
        server.add(session_pb2_grpc.add_SessionServiceServicer_to_server, servicer, SERVICE_NAME)

    async def stop(self) -> None:
        if getattr(self, "gateway", None) is not None:
            await self.gateway.close()
        await super().stop()


def build(config: SessionServerConfig) -> SessionServerApp:
    return SessionServerApp(config, "rlfleet-session-server")
