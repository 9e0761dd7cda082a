"""Console script `rlfleet-trainer`: parses config first, imports the service after (instant --help).

Under torchrun, rank 0 runs the service and the other ranks follow it (learner.follow). With
`--standby` (one process, not under torchrun) it first imports what training needs and waits to
be promoted (rlfleet.common.standby, trainer/standby.py).
"""

from __future__ import annotations

import os
import signal

from rlfleet.trainer import standby, startup

NAME = "rlfleet-trainer"


def is_follower() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) > 0


def follow() -> None:
    """A rank >= 1: trains what rank 0 sends until rank 0 closes (or dies, which fails the collective)."""
    from rlfleet.common.service import start_process
    from rlfleet.trainer.service_config import TrainerConfig

    config = start_process(NAME, TrainerConfig, log_name=f"{NAME}-rank{os.environ['RANK']}")
    if not config.has_model:
        return  # rank 0 only serves status; nothing to follow
    # torchrun forwards SIGTERM to every rank; rank 0 still needs this one for its last checkpoint.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    from rlfleet.trainer.learner import follow as follow_rank0

    follow_rank0(config)


def main() -> None:
    startup.begin()  # what came before: the interpreter and this script's imports
    if is_follower():
        follow()
    else:
        from rlfleet.common.service import run_service
        from rlfleet.trainer.service_config import TrainerConfig

        # A standby's start is timed from its promotion.
        run_service(NAME, TrainerConfig, "rlfleet.trainer.app:build", warm_up=standby.warm_up,
                    promoted=startup.begin)


if __name__ == "__main__":
    main()
