"""TrainerService over gRPC: status, checkpoint now, pause/resume consuming."""

from __future__ import annotations

import logging

from nats.errors import Error as NatsError

from rlfleet.api.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from rlfleet.common.errors import FailedPrecondition
from rlfleet.trainer.service_config import TrainerConfig

log = logging.getLogger(__name__)

NO_MODEL = ("no model_path configured: the trainer serves health and status but does not consume or train "
            "(start it with --model-path DIR, an HF model directory)")


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, config: TrainerConfig, loop=None) -> None:
        self.config = config
        self.loop = loop  # None: no model configured
        self._queue_depth = 0

    async def GetStatus(self, request, context) -> trainer_pb2.TrainerStatus:
        status = trainer_pb2.TrainerStatus(run_id=self.config.run_id, loss=self.config.loss.algorithm)
        loop = self.loop
        if loop is None:
            status.policy_version = -1
            status.state, status.state_message = "no_model", NO_MODEL
            return status
        status.state, status.state_message = loop.describe()
        status.policy_version = loop.version
        status.step = loop.learner.step
        status.paused = loop.intake.paused
        status.queue_depth = await self._depth(loop)
        status.pending_groups = len(loop.intake.buffer)
        status.pending_samples = loop.intake.buffer.held_samples()
        status.trained_trajectories = loop.ledger.trained_count
        status.dropped_by_reason.update(loop.intake.dropped_by_reason)
        status.last_metrics.update(loop.last_metrics)
        status.idle_fraction = loop.idle_fraction
        status.last_checkpoint = loop.last_checkpoint
        return status

    async def Checkpoint(self, request, context) -> trainer_pb2.CheckpointResponse:
        loop = self._require_model()
        if loop.state == "starting":
            raise FailedPrecondition("the trainer is still starting (loading the model or a checkpoint)")
        path = await loop.checkpoint_now()
        return trainer_pb2.CheckpointResponse(path=str(path), step=loop.learner.step,
                                              policy_version=loop.version)

    async def Pause(self, request, context) -> trainer_pb2.PauseResponse:
        if self.loop is not None:
            await self.loop.pause()
        return trainer_pb2.PauseResponse()

    async def Resume(self, request, context) -> trainer_pb2.ResumeResponse:
        if self.loop is not None:
            await self.loop.resume()
        return trainer_pb2.ResumeResponse()

    def _require_model(self):
        if self.loop is None:
            raise FailedPrecondition(NO_MODEL)
        return self.loop

    async def _depth(self, loop) -> int:
        """The consumer's queue depth; the last known one when NATS does not answer in time."""
        try:
            self._queue_depth = await loop.consumer.queue_depth()
        except (TimeoutError, NatsError) as exc:
            log.warning("queue depth unavailable: %s", exc)
        return self._queue_depth
