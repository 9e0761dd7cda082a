"""Console script `rlfleet-verifier`: parses config first, imports the service after (instant --help)."""

from __future__ import annotations

from rlfleet.common.service import run_service
from rlfleet.verifier.config import VerifierConfig


def main() -> None:
    run_service("rlfleet-verifier", VerifierConfig, "rlfleet.verifier.app:build")


if __name__ == "__main__":
    main()
