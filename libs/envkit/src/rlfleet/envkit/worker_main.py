"""`rlfleet-worker`: a rollout worker process. Config first (so `--help` is instant), then the rest.

    rlfleet-worker --run-id local --nats.url nats://127.0.0.1:4222 --session-address 127.0.0.1:7002 \\
        --sandbox-address 127.0.0.1:7003 --verifier-address 127.0.0.1:7004 --concurrency 8

Stops on SIGTERM/SIGINT: takes no new task, lets running groups finish for `drain_timeout_s`, aborts
the rest (their tasks are redelivered to another worker).
"""

from __future__ import annotations

import logging
import os

from rlfleet.common.service import run_process, stop_on_signals, write_ready_file
from rlfleet.common.telemetry import setup_telemetry
from rlfleet.envkit.worker_config import WorkerConfig

NAME = "rlfleet-worker"
log = logging.getLogger(__name__)


async def serve(config: WorkerConfig) -> None:
    from rlfleet.envkit.worker import RolloutWorker  # its clients and task suites: after --help

    telemetry = setup_telemetry(NAME, config.telemetry, config.metrics)
    stop = stop_on_signals()
    worker = RolloutWorker(config)
    try:
        await worker.start()
        if config.ready_file:
            write_ready_file(config.ready_file, {"service": NAME, "pid": os.getpid(),
                                                 "metrics_port": telemetry.metrics_port})
        stats = await worker.run(stop)
        log.info("stopped", extra={"tasks_acked": stats.tasks_acked,
                                   "tasks_dead_lettered": stats.tasks_dead_lettered,
                                   "episodes": dict(stats.episodes)})
    finally:
        telemetry.shutdown(config.telemetry.export_timeout_s)


def main(argv: list[str] | None = None) -> None:
    run_process(NAME, WorkerConfig, serve, argv)


if __name__ == "__main__":
    main()
