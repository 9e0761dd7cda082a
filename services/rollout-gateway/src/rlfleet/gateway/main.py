"""Console script `rlfleet-gateway`: parses config first, imports the service after (instant --help)."""

from __future__ import annotations

from rlfleet.common.service import run_service
from rlfleet.gateway.config import RolloutGatewayConfig


def build_app(config: RolloutGatewayConfig):
    from rlfleet.gateway.app import build

    return build(config)


def main() -> None:
    run_service("rlfleet-gateway", RolloutGatewayConfig, build_app)


if __name__ == "__main__":
    main()
