"""Configuration of the sandbox-manager service."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from rlfleet.common.config import RedisConfig, ServiceConfig, StrictModel
from rlfleet.sandbox.errors import InvalidSandboxRequest
from rlfleet.sandbox.limits import GiB, Limits, MiB


class LimitsConfig(StrictModel):
    """Per-exec resource limits (see rlfleet.sandbox.limits.LIMIT_RANGES for the platform's hard ranges)."""

    cpu_seconds: float = Field(10.0, description="CPU seconds per process (RLIMIT_CPU)")
    memory_bytes: int = Field(512 * MiB, description="resident memory of the sandbox")
    wall_seconds: float = Field(30.0, description="wall-clock seconds per exec")
    max_processes: int = Field(64, description="processes and threads at once")
    max_file_bytes: int = Field(64 * MiB, description="size of any one file written")
    max_output_bytes: int = Field(1 * MiB, description="stdout and stderr kept per exec, each")

    @model_validator(mode="after")
    def _in_platform_ranges(self) -> LimitsConfig:
        try:
            self.as_limits()
        except InvalidSandboxRequest as exc:
            raise ValueError(str(exc)) from None
        return self

    def as_limits(self) -> Limits:
        return Limits(**self.model_dump())


class BubblewrapConfig(StrictModel):
    """The bubblewrap driver: where sandboxes live, their uids, the warm pool, cgroups, its own limits."""

    root: Path = Field(Path("/var/lib/rlfleet/sandboxes"),
                       description="directory holding sandbox workspaces (one driver each)")
    pool_size: int = Field(4, ge=0, description="sandboxes kept ready for a fast create")
    uid_base: int | None = Field(None, ge=1000,
                                 description="pin the uid range: sandboxes run as uids uid_base .. "
                                 "uid_base+max_sandboxes-1 (refused at start when another driver on the host "
                                 "leases any of them); unset: lease a free range in the search window")
    uid_search_from: int = Field(200_000, ge=1000, description="lowest uid an unpinned range may start at")
    uid_search_to: int = Field(2_000_000, le=2**31 - 1, description="an unpinned range ends below this uid")
    uid_lease_dir: Path = Field(Path("/run/rlfleet/sandbox-uids"),
                                description="host-wide directory of uid-range leases; every driver on the "
                                "host must use the same one")
    max_sandboxes: int = Field(256, ge=1, le=65536, description="sandbox slots (one uid each), warm pool "
                               "included; beyond: RESOURCE_EXHAUSTED")
    cgroups: Literal["auto", "off", "require"] = Field(
        "auto", description="memory/pids cgroups: auto (use when the host allows), off, or require")
    cgroup_parent: str | None = Field(None,
                                      description="cgroup v2: a delegated parent with memory+pids enabled")
    python_prefix: str | None = Field(None, description="the interpreter shown in sandboxes; default: "
                                      "realpath(sys.base_prefix), the real interpreter")
    extra_ro_binds: tuple[str, ...] = Field((), description="more host dirs shown read-only (toolchains)")
    tmp_size_bytes: int = Field(64 * MiB, ge=1, description="size of each of /tmp and /dev/shm")
    workspace_bytes: int = Field(256 * MiB, ge=1 * MiB,
                                 description="size quota of each sandbox's workspace (a tmpfs: memory, never "
                                 "the host's disk); a write past it fails with ENOSPC")
    workspace_inodes: int = Field(10_000, ge=16,
                                  description="files, directories and symlinks each workspace may hold")
    max_read_bytes: int = Field(32 * MiB, ge=1, description="bytes one ReadFiles call may return in total")
    max_write_bytes: int = Field(256 * MiB, ge=1,
                                 description="bytes one WriteFiles call (or a spec's files) may write")
    max_list_entries: int = Field(100_000, ge=1, description="entries one listing may return")
    reap_interval_s: float = Field(2.0, gt=0, description="how often expired sandboxes are destroyed")
    bwrap: str = Field("bwrap", description="the bubblewrap executable")

    @model_validator(mode="after")
    def _search_window_fits(self) -> BubblewrapConfig:
        if self.uid_base is None and self.uid_search_from + self.max_sandboxes > self.uid_search_to:
            raise ValueError("uid_search_from..uid_search_to is smaller than max_sandboxes")
        if self.uid_base is not None and self.uid_base + self.max_sandboxes > 2**31:
            raise ValueError("uid_base + max_sandboxes is above 2**31")
        return self


def _max_limits() -> LimitsConfig:
    return LimitsConfig(cpu_seconds=600, memory_bytes=4 * GiB, wall_seconds=600, max_processes=512,
                        max_file_bytes=1 * GiB, max_output_bytes=16 * MiB)


class SandboxManagerConfig(ServiceConfig):
    """Sandbox manager: a fresh isolated sandbox per episode."""

    redis: RedisConfig = Field(default_factory=RedisConfig)
    driver: BubblewrapConfig = Field(default_factory=BubblewrapConfig)
    default_limits: LimitsConfig = Field(default_factory=LimitsConfig,
                                         description="limits for fields a create request leaves at 0")
    max_limits: LimitsConfig = Field(default_factory=_max_limits,
                                     description="largest limits a create request may ask for")
    default_ttl_s: float = Field(3600.0, gt=0, description="sandbox lifetime when a request gives none")
    max_ttl_s: float = Field(2 * 3600.0, gt=0, le=7 * 24 * 3600,
                             description="longest lifetime a request may ask for (beyond: INVALID_ARGUMENT)")
    max_open_sandboxes: int = Field(256, ge=1, description="sandboxes open at once for this run (one manager "
                                    "serves one run), warm pool not counted; beyond: RESOURCE_EXHAUSTED")
    max_sandboxes_per_client: int = Field(128, ge=1,
                                          description="sandboxes one client (the rlfleet-client-id metadata, "
                                          "else the client_id label, else 'anonymous') may hold open")
    allow_network: bool = Field(False,
                                description="let create requests turn networking on (off: INVALID_ARGUMENT)")
    default_read_bytes_per_file: int = Field(8 * MiB, ge=1,
                                             description="per-file read cap when a request gives none")
    heartbeat_s: float = Field(5.0, gt=0, description="how often this manager refreshes its liveness key")
    lease_grace_s: float = Field(60.0, ge=0,
                                 description="Redis keeps a lease this long past its sandbox's expiry")

    @model_validator(mode="after")
    def _defaults_within_maxima(self) -> SandboxManagerConfig:
        for name, default in self.default_limits.model_dump().items():
            if default > getattr(self.max_limits, name):
                raise ValueError(f"default_limits.{name}={default} is above max_limits.{name}")
        if self.max_sandboxes_per_client > self.max_open_sandboxes:
            raise ValueError("max_sandboxes_per_client is above max_open_sandboxes")
        if self.default_ttl_s > self.max_ttl_s:
            raise ValueError("default_ttl_s is above max_ttl_s")
        if self.default_read_bytes_per_file > self.driver.max_read_bytes:
            raise ValueError("default_read_bytes_per_file is above driver.max_read_bytes")
        return self
