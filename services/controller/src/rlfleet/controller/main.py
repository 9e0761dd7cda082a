"""Console script `rlfleet-controller`: parses config first, imports the service after (instant --help)."""

from __future__ import annotations

from rlfleet.common.service import run_service
from rlfleet.controller.config import ControllerConfig


def main() -> None:
    run_service("rlfleet-controller", ControllerConfig, "rlfleet.controller.app:build")


if __name__ == "__main__":
    main()
