"""The weight-broker service process: registry, pools, broker loop, POLICY consumer and the RPCs."""

from __future__ import annotations

from rlfleet.api.broker.v1 import broker_pb2, broker_pb2_grpc
from rlfleet.broker.broker import Broker
from rlfleet.broker.config import WeightBrokerConfig
from rlfleet.broker.consumer import PolicyConsumer
from rlfleet.broker.metrics import BrokerMetrics
from rlfleet.broker.pools import GatewayLink, Pools
from rlfleet.broker.registry import VersionRegistry
from rlfleet.broker.servicer import BrokerServicer
from rlfleet.common.config import require
from rlfleet.common.engine_client import EngineTimeouts
from rlfleet.common.grpc_server import GrpcServer
from rlfleet.common.peers import PeersApp
from rlfleet.weights import DirectoryWeightStore

SERVICE_NAME = broker_pb2.DESCRIPTOR.services_by_name["BrokerService"].full_name


class WeightBrokerApp(PeersApp):
    uses_nats = True
    uses_redis = True
    config: WeightBrokerConfig

    def __init__(self, config: WeightBrokerConfig, name: str) -> None:
        super().__init__(config, name)
        self.uses_nats = config.consume_policy_stream
        self.gateway: GatewayLink | None = None
        self.pools: Pools | None = None
        self.broker: Broker | None = None
        self.consumer: PolicyConsumer | None = None

    async def start(self, server: GrpcServer) -> None:
        config = self.config
        store = DirectoryWeightStore(require(config.weight_store, "weight_store"), config.run_id)
        await self.connect()
        self.gateway = GatewayLink(config.gateway_address) if config.gateway_address else None
        timeouts = EngineTimeouts(weights_s=config.sync.update_timeout_s)
        self.pools = Pools(config.engines, self.gateway, timeouts, api_key=config.engine_api_key,
                           admin_api_key=config.engine_admin_api_key)
        registry = VersionRegistry(self.connected_redis(), config.run_id)
        self.broker = Broker(config, registry, store, self.pools, self.gateway, BrokerMetrics())
        if config.consume_policy_stream:
            self.consumer = PolicyConsumer(self.connected_js(), config.run_id, self.broker.announce)
            await self.consumer.start()
        self.broker.start()
        server.add(broker_pb2_grpc.add_BrokerServiceServicer_to_server,
                   BrokerServicer(self.broker), SERVICE_NAME)

    async def stop(self) -> None:
        if self.consumer is not None:
            await self.consumer.stop()
        if self.broker is not None:
            await self.broker.stop()
        if self.pools is not None:
            await self.pools.close()
        if self.gateway is not None:
            await self.gateway.close()
        await super().stop()


def build(config: WeightBrokerConfig) -> WeightBrokerApp:
    return WeightBrokerApp(config, "rlfleet-weight-broker")
