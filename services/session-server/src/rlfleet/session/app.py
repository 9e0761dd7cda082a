"""The session-server service process: tokenizer and template, Redis state, the gateway, the stream."""

from __future__ import annotations

import asyncio
import contextlib
import logging

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

log = logging.getLogger(__name__)
SERVICE_NAME = session_pb2.DESCRIPTOR.services_by_name["SessionService"].full_name


class SessionServerApp(PeersApp):
    uses_nats = True
    uses_redis = True
    config: SessionServerConfig

    async def start(self, server: GrpcServer) -> None:
        config = self.config
        await self.connect()
        redis = self.connected_redis()
        tokenizer_path = require(config.tokenizer_path, "tokenizer_path")
        gateway_address = require(config.gateway_address, "gateway_address")
        tokenizer = Tokenizer(tokenizer_path)
        renderer = load_chat_renderer(tokenizer_path, config.chat_template)
        limits = Limits(context_length=config.context_length or model_context_length(tokenizer_path),
                        default_budget=config.max_total_tokens, max_text_chars=config.max_text_chars,
                        max_metadata_bytes=config.max_metadata_bytes)
        metrics = SessionMetrics()
        store = SessionStore(redis, config.run_id, config.session_ttl_s, config.max_open_sessions)
        self.gateway = GatewayClient(gateway_address, config.gateway_timeout_s)
        publisher = TrajectoryPublisher(self.connected_js(), config.run_id, config.publish_timeout_s)
        closer = Closer(store, redis, publisher, self.gateway, metrics)
        servicer = SessionServicer(config.run_id, store, Inputs(tokenizer, renderer, limits),
                                   self.gateway, closer, metrics)
        server.add(session_pb2_grpc.add_SessionServiceServicer_to_server, servicer, SERVICE_NAME)
        self.expiry = asyncio.create_task(self._expire_idle(closer))

    async def _expire_idle(self, closer: Closer) -> None:
        """Closes sessions nobody calls any more, so they are published and free their admission slot."""
        while True:
            await asyncio.sleep(self.config.expiry_sweep_s)
            try:
                await closer.expire_idle(self.config.session_idle_timeout_s)
            except Exception:  # Redis away for a moment: the next sweep tries again
                log.exception("expiring idle sessions failed")

    async def stop(self) -> None:
        if getattr(self, "expiry", None) is not None:
            self.expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.expiry
        if getattr(self, "gateway", None) is not None:
            await self.gateway.close()
        await super().stop()


def build(config: SessionServerConfig) -> SessionServerApp:
    return SessionServerApp(config, "rlfleet-session-server")
