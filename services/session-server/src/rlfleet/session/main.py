"""Console script `rlfleet-session-server`: parses config first, imports the service after (instant --help)."""

from __future__ import annotations

from rlfleet.common.service import run_service
from rlfleet.session.config import SessionServerConfig


def build_app(config: SessionServerConfig):
    from rlfleet.session.app import build

    return build(config)


def main() -> None:
    run_service("rlfleet-session-server", SessionServerConfig, build_app)


if __name__ == "__main__":
    main()
