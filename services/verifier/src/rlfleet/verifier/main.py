"""Console script `rlfleet-verifier`: parses config first, imports the service after (instant --help).

`rlfleet-verifier audit ...` runs the offline audit instead (`rlfleet.verifier.audit_cli`).
"""

from __future__ import annotations

import sys

from rlfleet.common.service import run_service
from rlfleet.verifier.config import VerifierConfig


def main() -> None:
    if sys.argv[1:2] == ["audit"]:
        from rlfleet.verifier.audit_cli import main as audit

        audit(sys.argv[2:])
        return
    run_service("rlfleet-verifier", VerifierConfig, "rlfleet.verifier.app:build")


if __name__ == "__main__":
    main()
