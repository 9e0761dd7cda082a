"""Test helpers: a `rlfleet-weight-broker` process on free ports (stopped by PID), and the
PolicyVersion a trainer announces."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rlfleet.api.common.v1 import common_pb2
from rlfleet.common.processes import ServiceProcess

FORMATS = {"full": common_pb2.WEIGHT_FORMAT_FULL, "delta": common_pb2.WEIGHT_FORMAT_DELTA,
           "adapter": common_pb2.WEIGHT_FORMAT_ADAPTER}


class BrokerProcess(ServiceProcess):
    """`rlfleet-weight-broker` with `settings` as its config (keys may be dotted), reconciling every
    half second."""

    def __init__(self, workdir: Path, **settings: Any) -> None:
        config = {"log.format": "text", "reconcile_interval_s": 0.5, **settings}
        super().__init__("rlfleet-weight-broker", workdir, config=config)

    def start(self, timeout_s: float = 30.0) -> BrokerProcess:
        super().start(timeout_s)
        return self


def policy_version(manifest: dict[str, Any], **extra: Any) -> common_pb2.PolicyVersion:
    """The PolicyVersion a trainer announces for a store manifest (`DirectoryWeightStore.write_version`)."""
    full = manifest["full_version"]
    return common_pb2.PolicyVersion(
        schema_version=common_pb2.SCHEMA_VERSION_1,
        run_id=manifest["run_id"],
        version=manifest["version"],
        parent_version=extra.pop("parent_version", manifest["version"] - 1),
        format=FORMATS[manifest["kind"]],
        base_version=manifest["base_version"] if manifest["base_version"] is not None else -1,
        uri=manifest["uri"],
        full_uri=Path(manifest["path"]).with_name(f"v{full:06d}").as_uri() if full is not None else "",
        checksum=manifest["checksum"],
        num_bytes=manifest["bytes"],
        created_unix_ms=int(time.time() * 1000),
        served_dtype="bf16",
        **extra,
    )
