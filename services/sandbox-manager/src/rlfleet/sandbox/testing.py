"""Test helpers: a sandbox manager as a real process on its own root and uid range.

Used by this service's integration tests and by the services that call it (the verifier).
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

from rlfleet.common.processes import ServiceProcess


def sandbox_manager_config(redis_url: str, run_id: str, workdir: Path, **settings: Any) -> dict[str, Any]:
    """A manager on `workdir/sandboxes` with a uid range of its own (derived from the path) and no
    warm pool."""
    uid_base = 700_000 + (zlib.crc32(str(workdir).encode()) % 5000) * 64
    return {"redis.url": redis_url, "run_id": run_id, "driver.root": str(workdir / "sandboxes"),
            "driver.uid_base": uid_base, "driver.max_sandboxes": 64, "driver.pool_size": 0, **settings}


def start_sandbox_manager(redis_url: str, run_id: str, workdir: Path, **settings: Any) -> ServiceProcess:
    config = sandbox_manager_config(redis_url, run_id, workdir, **settings)
    return ServiceProcess("rlfleet-sandbox-manager", workdir, config=config).start(30.0)
