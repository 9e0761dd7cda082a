"""The trainer service process: gRPC status/control in front, the training loop behind.

The server answers health and status at once; the model loads and the loop runs in the
background (GetStatus says `starting` meanwhile). Without a model_path the trainer only serves
health and status (`no_model`), so `rlfleet up` without a model still comes up healthy. An
unexpected error in the loop ends the process with status 1 after logging it: a supervisor
restarts it and it resumes from its last checkpoint, which is exactly what the ack discipline
makes safe.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rlfleet.api.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from rlfleet.common.config import require
from rlfleet.common.errors import StartupError
from rlfleet.common.grpc_server import GrpcServer
from rlfleet.common.peers import PeersApp
from rlfleet.trainer import startup
from rlfleet.trainer.service_config import TrainerConfig
from rlfleet.trainer.servicer import NO_MODEL, TrainerServicer

if TYPE_CHECKING:
    from rlfleet.common.queue_metrics import QueueDepthPoller
    from rlfleet.trainer.learner import Worker
    from rlfleet.trainer.loop import TrainerLoop

log = logging.getLogger(__name__)
SERVICE_NAME = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name


class TrainerApp(PeersApp):
    uses_nats = True
    uses_redis = False

    def __init__(self, config: TrainerConfig, name: str) -> None:
        super().__init__(config, name)
        self.config: TrainerConfig = config
        self.loop: TrainerLoop | None = None
        self.task: asyncio.Task | None = None
        self.worker: Worker | None = None
        self.depth: QueueDepthPoller | None = None

    async def start(self, server: GrpcServer) -> None:
        await self.connect()
        startup.mark("peers_connected")
        if self.config.has_model:
            await self._start_training()
        else:
            log.warning(NO_MODEL)
        server.add(trainer_pb2_grpc.add_TrainerServiceServicer_to_server,
                   TrainerServicer(self.config, self.loop), SERVICE_NAME)

    async def _start_training(self) -> None:
        cfg = self.config
        if not (Path(cfg.model_path) / "config.json").is_file():
            raise StartupError(f"model_path {cfg.model_path} is not an HF model directory (no config.json)")
        require(cfg.weight_store, "weight_store")
        # The training machinery imports torch: a trainer without a model (health and status only)
        # comes up without paying for it.
        from rlfleet.common.queue_metrics import QueueDepthPoller
        from rlfleet.trainer.consumer import STREAM, TrajectoryConsumer
        from rlfleet.trainer.learner import Worker
        from rlfleet.trainer.loop import TrainerLoop
        from rlfleet.weights import DirectoryWeightStore

        startup.mark("training_imports")
        # Full checkpoints carry the model's config and tokenizer files.
        weights = cfg.weights if cfg.weights.base_dir else cfg.weights.model_copy(
            update={"base_dir": Path(cfg.model_path)})
        store = DirectoryWeightStore(cfg.weight_store, cfg.run_id, weights)
        consumer = TrajectoryConsumer(self.js, cfg.run_id, cfg.consumer_name(), cfg.consumer)
        await consumer.start()
        startup.mark("consumer_attached")
        self.depth = QueueDepthPoller(self.js, STREAM, consumer.name)
        self.depth.start()
        self.worker = Worker()
        self.loop = TrainerLoop(cfg, consumer, store, self.js, self.worker)
        self.task = asyncio.create_task(self.loop.run())
        self.task.add_done_callback(self._on_loop_exit)

    def _on_loop_exit(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        log.critical("training loop failed; exiting so that a supervisor restarts the trainer from its last "
                     "checkpoint", exc_info=task.exception())
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        os._exit(1)

    async def stop(self) -> None:
        if self.depth is not None:
            await self.depth.stop()
        if self.loop is not None and self.task is not None:
            assert self.worker is not None  # made before the loop
            await self.loop.shutdown(self.task)
            await self.loop.consumer.stop()
            await self.worker.call(self.loop.learner.close)
            self.worker.shutdown()
        await super().stop()


def build(config: TrainerConfig) -> TrainerApp:
    startup.mark("config_and_service_imports")
    return TrainerApp(config, "rlfleet-trainer")
