"""Console script `rlfleet-trainer`: parses config first, imports the service after (instant --help)."""

from __future__ import annotations

from rlfleet.common.service import run_service
from rlfleet.trainer.service_config import TrainerConfig


def build_app(config: TrainerConfig):
    from rlfleet.trainer.app import build

    return build(config)


def main() -> None:
    run_service("rlfleet-trainer", TrainerConfig, build_app)


if __name__ == "__main__":
    main()
