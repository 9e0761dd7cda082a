"""The sandbox-manager service process: Redis, the bubblewrap driver, leases, the gRPC servicer."""

from __future__ import annotations

import logging

from rlfleet.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from rlfleet.common.errors import StartupError
from rlfleet.common.grpc_server import GrpcServer
from rlfleet.common.peers import PeersApp
from rlfleet.sandbox.bubblewrap import BubblewrapDriver
from rlfleet.sandbox.config import SandboxManagerConfig
from rlfleet.sandbox.errors import SandboxDriverUnavailable
from rlfleet.sandbox.leases import LeaseStore, Owner
from rlfleet.sandbox.manager import OpenCaps, ReadLimits, SandboxManager
from rlfleet.sandbox.policy import RequestPolicy
from rlfleet.sandbox.servicer import SandboxServicer

SERVICE_NAME = sandbox_pb2.DESCRIPTOR.services_by_name["SandboxService"].full_name
log = logging.getLogger(__name__)


class SandboxManagerApp(PeersApp):
    uses_nats = False
    uses_redis = True
    config: SandboxManagerConfig

    def __init__(self, config: SandboxManagerConfig, name: str) -> None:
        super().__init__(config, name)
        self.manager: SandboxManager | None = None

    async def start(self, server: GrpcServer) -> None:
        await self.connect()
        self.manager = build_manager(self.config, self.redis)
        try:
            recovery = await self.manager.start()
        except SandboxDriverUnavailable as exc:
            self.manager = None
            raise StartupError(f"sandbox driver unavailable: {exc}") from None
        log.info("sandbox manager ready", extra={
            "instance": self.manager.leases.owner.instance_id, "root": str(self.config.driver.root),
            "predecessor_leases_removed": len(recovery.predecessor_leases),
            "dead_owner_leases_removed": len(recovery.dead_owner_leases)})
        server.add(sandbox_pb2_grpc.add_SandboxServiceServicer_to_server,
                   SandboxServicer(self.manager), SERVICE_NAME)

    async def stop(self) -> None:
        try:
            if self.manager is not None:
                await self.manager.close()
        finally:
            await super().stop()


def build_manager(config: SandboxManagerConfig, redis) -> SandboxManager:
    driver = BubblewrapDriver(config.driver)
    leases = LeaseStore(redis, config.run_id, Owner.this_process(str(config.driver.root)),
                        grace_s=config.lease_grace_s, heartbeat_s=config.heartbeat_s)
    policy = RequestPolicy(config.default_limits.as_limits(), config.max_limits.as_limits(),
                           config.default_ttl_s, config.max_ttl_s, config.allow_network)
    reads = ReadLimits(config.driver.max_read_bytes, config.default_read_bytes_per_file)
    return SandboxManager(driver, leases, policy, reads, reap_interval_s=config.driver.reap_interval_s,
                          pool_size=lambda: len(driver.pool),
                          caps=OpenCaps(per_run=config.max_open_sandboxes,
                                        per_client=config.max_sandboxes_per_client))


def build(config: SandboxManagerConfig) -> SandboxManagerApp:
    return SandboxManagerApp(config, "rlfleet-sandbox-manager")
