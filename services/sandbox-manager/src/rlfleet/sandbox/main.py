"""Console script `rlfleet-sandbox-manager`: parses config first, imports the service after
(instant --help)."""

from __future__ import annotations

from rlfleet.common.service import run_service
from rlfleet.sandbox.config import SandboxManagerConfig


def main() -> None:
    run_service("rlfleet-sandbox-manager", SandboxManagerConfig, "rlfleet.sandbox.app:build")


if __name__ == "__main__":
    main()
