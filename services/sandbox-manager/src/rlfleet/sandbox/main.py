"""Console script `rlfleet-sandbox-manager`: parses config first, imports the service after (instant --help)."""

from __future__ import annotations

from rlfleet.common.service import run_service
from rlfleet.sandbox.config import SandboxManagerConfig


def build_app(config: SandboxManagerConfig):
    from rlfleet.sandbox.app import build

    return build(config)


def main() -> None:
    run_service("rlfleet-sandbox-manager", SandboxManagerConfig, build_app)


if __name__ == "__main__":
    main()
