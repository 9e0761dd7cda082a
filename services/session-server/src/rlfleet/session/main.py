"""Console script `rlfleet-session-server`: parses config first, imports the service after
(instant --help)."""

from __future__ import annotations

from rlfleet.common.service import run_service
from rlfleet.session.config import SessionServerConfig


def main() -> None:
    run_service("rlfleet-session-server", SessionServerConfig, "rlfleet.session.app:build")


if __name__ == "__main__":
    main()
