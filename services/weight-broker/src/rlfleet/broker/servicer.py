"""The BrokerService RPCs: thin translations onto `Broker` (errors map to statuses in the interceptor)."""

from __future__ import annotations

from rlfleet.api.broker.v1 import broker_pb2, broker_pb2_grpc
from rlfleet.api.common.v1 import common_pb2
from rlfleet.broker.broker import Broker
from rlfleet.common.errors import require_known_enums


class BrokerServicer(broker_pb2_grpc.BrokerServiceServicer):
    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    async def PublishVersion(
        self, request: common_pb2.PolicyVersion, context
    ) -> broker_pb2.PublishVersionResponse:
        require_known_enums(request)
        return broker_pb2.PublishVersionResponse(state=await self.broker.announce(request))

    async def GetStatus(self, request: broker_pb2.GetStatusRequest, context) -> broker_pb2.BrokerStatus:
        return await self.broker.status()

    async def ListVersions(
        self, request: broker_pb2.ListVersionsRequest, context
    ) -> broker_pb2.ListVersionsResponse:
        return broker_pb2.ListVersionsResponse(versions=await self.broker.list_versions(request.limit))

    async def Promote(self, request: broker_pb2.PromoteRequest, context) -> broker_pb2.PromoteResponse:
        return broker_pb2.PromoteResponse(
            accepted_version=await self.broker.promote(request.version, request.reason))

    async def PinCandidate(
        self, request: broker_pb2.PinCandidateRequest, context
    ) -> broker_pb2.PinCandidateResponse:
        return broker_pb2.PinCandidateResponse(
            candidate_version=await self.broker.pin_candidate(request.version, request.reason))

    async def Rollback(self, request: broker_pb2.RollbackRequest, context) -> broker_pb2.RollbackResponse:
        version = await self.broker.rollback(request.to_version, request.reason)
        return broker_pb2.RollbackResponse(accepted_version=version)

    async def StartDistributedSync(
        self, request: broker_pb2.StartDistributedSyncRequest, context
    ) -> broker_pb2.StartDistributedSyncResponse:
        require_known_enums(request)
        return await self.broker.start_distributed(request)

    async def StartTrainerSync(
        self, request: broker_pb2.StartTrainerSyncRequest, context
    ) -> broker_pb2.TrainerSyncPlan:
        require_known_enums(request)
        return await self.broker.trainer_syncs.start(request)

    async def FinishTrainerSync(
        self, request: broker_pb2.FinishTrainerSyncRequest, context
    ) -> broker_pb2.FinishTrainerSyncResponse:
        require_known_enums(request)
        return await self.broker.trainer_syncs.finish(request)

    async def ConfirmTrainerSync(
        self, request: broker_pb2.ConfirmTrainerSyncRequest, context
    ) -> broker_pb2.ConfirmTrainerSyncResponse:
        require_known_enums(request)
        return await self.broker.trainer_syncs.confirm(request)
