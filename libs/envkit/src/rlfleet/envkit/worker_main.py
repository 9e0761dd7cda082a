"""`rlfleet-worker`: a rollout worker process. Config first (so `--help` is instant), then the rest.

    rlfleet-worker --run-id local --nats.url nats://127.0.0.1:4222 --session-address 127.0.0.1:7002 \\
        --sandbox-address 127.0.0.1:7003 --verifier-address 127.0.0.1:7004 --concurrency 8

Stops on SIGTERM/SIGINT: takes no new task, lets running groups finish for `drain_timeout_s`, aborts
the rest (their tasks are redelivered to another worker).
"""

from __future__ import annotations

import sys

from rlfleet.common.config import ConfigError, load_config
from rlfleet.envkit.worker_config import WorkerConfig

NAME = "rlfleet-worker"


async def serve(config: WorkerConfig) -> None:
    import asyncio
    import logging
    import os
    import signal

    from rlfleet.common.service import write_ready_file
    from rlfleet.common.telemetry import setup_telemetry
    from rlfleet.envkit.worker import RolloutWorker

    telemetry = setup_telemetry(NAME, config.telemetry, config.metrics)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    worker = RolloutWorker(config)
    try:
        await worker.start()
        if config.ready_file:
            write_ready_file(config.ready_file, {"service": NAME, "pid": os.getpid(),
                                                 "metrics_port": telemetry.metrics_port})
        stats = await worker.run(stop)
        logging.getLogger(__name__).info(
            "stopped", extra={"tasks_acked": stats.tasks_acked, "tasks_dead_lettered": stats.tasks_dead_lettered,
                              "episodes": dict(stats.episodes)})
    finally:
        telemetry.shutdown(config.telemetry.export_timeout_s)


def main(argv: list[str] | None = None) -> None:
    try:
        config = load_config(WorkerConfig, argv, prog=NAME)
    except ConfigError as exc:
        print(f"{NAME}: config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    from rlfleet.common.errors import StartupError
    from rlfleet.common.logs import setup_logging

    setup_logging(NAME, config.log.level, config.log.format)
    import uvloop

    try:
        uvloop.run(serve(config))
    except (StartupError, ConfigError) as exc:
        print(f"{NAME}: cannot start: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
