"""Console script `rlfleet-weight-broker`: parses config first, imports the service after (instant --help)."""

from __future__ import annotations

from rlfleet.broker.config import WeightBrokerConfig
from rlfleet.common.service import run_service


def build_app(config: WeightBrokerConfig):
    from rlfleet.broker.app import build

    return build(config)


def main() -> None:
    run_service("rlfleet-weight-broker", WeightBrokerConfig, build_app)


if __name__ == "__main__":
    main()
