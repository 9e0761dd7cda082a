"""Console script `rlfleet-weight-broker`: parses config first, imports the service after (instant --help)."""

from __future__ import annotations

from rlfleet.broker.config import WeightBrokerConfig
from rlfleet.common.service import run_service


def main() -> None:
    run_service("rlfleet-weight-broker", WeightBrokerConfig, "rlfleet.broker.app:build")


if __name__ == "__main__":
    main()
