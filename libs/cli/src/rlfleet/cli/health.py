"""Health of a launched platform: gRPC health for services, PING for NATS and Redis."""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass

from rlfleet.cli.launcher import PlatformState, ProcessRecord, is_ours
from rlfleet.common import security
from rlfleet.common.grpc_server import check_health


@dataclass
class Health:
    name: str
    pid: int
    address: str
    running: bool
    healthy: bool
    detail: str = ""
    restarts: int = 0        # times the launcher started it again (platform.json)
    last_exit: str = ""      # how it died the last time
    last_restart_unix: float = 0.0


async def _ping_line(address: str, expect: tuple[bytes, ...], timeout_s: float, greeting: bool,
                     tls: ssl.SSLContext | None = None) -> bool:
    """PING over TLS where `tls` is given: Redis from the first byte, NATS after its plaintext INFO."""
    host, port = address.rsplit(":", 1)
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, int(port), ssl=None if greeting else tls), timeout_s)
    except (TimeoutError, OSError):
        return False
    try:
        if greeting:
            await asyncio.wait_for(reader.readline(), timeout_s)  # NATS greets with INFO first
            if tls is not None:
                await asyncio.wait_for(writer.start_tls(tls), timeout_s)
        writer.write(b"PING\r\n")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout_s)
        return any(answer in line for answer in expect)
    except (TimeoutError, OSError):
        return False
    finally:
        writer.close()


async def _http_ok(address: str, path: str, timeout_s: float) -> bool:
    """GET `path` answers 200: engines speak SGLang's HTTP API, not gRPC."""
    host, port = address.rsplit(":", 1)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout_s)
    except (TimeoutError, OSError):
        return False
    try:
        writer.write(f"GET {path} HTTP/1.0\r\nHost: {address}\r\n\r\n".encode())
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), timeout_s)
        return status.split()[1:2] == [b"200"]
    except (TimeoutError, OSError):
        return False
    finally:
        writer.close()


async def probe_one(record: ProcessRecord, timeout_s: float = 2.0,
                    credentials: security.Credentials | None = None) -> Health:
    health = await _probe_one(record, timeout_s, credentials)
    health.restarts, health.last_exit = record.restarts, record.last_exit
    health.last_restart_unix = record.last_restart_unix
    return health


async def _probe_one(record: ProcessRecord, timeout_s: float,
                     credentials: security.Credentials | None) -> Health:
    running = is_ours(record)
    if not running:
        return Health(record.name, record.pid, record.address, False, False, "not running")
    if not record.address:
        return Health(record.name, record.pid, record.address, True, False, "no address yet")
    if record.kind in ("nats", "redis"):
        # Both are secured (rlfleet.common.infra_auth): a refusal to an anonymous PING is an answer.
        # Over TLS when launched so (tls://, rediss://), checked against the run's CA.
        tls = None
        if record.url.startswith(("tls://", "rediss://")):
            try:
                tls = security.client_ssl_context(credentials=credentials)
            except (security.StartupError, ssl.SSLError, OSError):
                return Health(record.name, record.pid, record.address, True, False,
                              "no credentials for its TLS")
        if record.kind == "nats":
            healthy = await _ping_line(record.address, (b"PONG", b"Authorization Violation"), timeout_s,
                                       greeting=True, tls=tls)
        else:
            healthy = await _ping_line(record.address, (b"+PONG", b"-NOAUTH"), timeout_s,
                                       greeting=False, tls=tls)
    elif record.kind == "engine":
        healthy = await _http_ok(record.address, "/health", timeout_s)
    else:
        healthy = await check_health(record.address, timeout_s=timeout_s, credentials=credentials)
    return Health(record.name, record.pid, record.address, True, healthy,
                  "" if healthy else "health check failed")


async def probe(state: PlatformState) -> list[Health]:
    """Every process's health, its services asked over TLS as the run's operator."""
    credentials = security.run_credentials(state.run_dir)
    return list(await asyncio.gather(*(probe_one(r, credentials=credentials) for r in state.processes)))


def table(rows: list[Health], state: PlatformState) -> str:
    records = {r.name: r for r in state.processes}
    header = ("process", "pid", "address", "metrics", "state", "log")
    lines = [header]
    for row in rows:
        record = records[row.name]
        status = "healthy" if row.healthy else ("running" if row.running else "stopped")
        if row.detail and not row.healthy:
            status += f" ({row.detail})"
        metrics = f"http://127.0.0.1:{record.metrics_port}/metrics" if record.metrics_port else "-"
        lines.append((row.name, str(row.pid), record.url or row.address or "-", metrics, status, record.log))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
                     for line in lines)
