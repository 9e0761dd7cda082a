"""Console script `rlfleet-gateway`: parses config first, imports the service after (instant --help)."""

from __future__ import annotations

from rlfleet.common.service import run_service
from rlfleet.gateway.config import RolloutGatewayConfig


def main() -> None:
    run_service("rlfleet-gateway", RolloutGatewayConfig, "rlfleet.gateway.app:build")


if __name__ == "__main__":
    main()
