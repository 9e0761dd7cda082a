"""The health checker: probes every engine each interval and keeps its live status in the registry.

A probe is SGLang 0.5.23's `/model_info` (its `weight_version`), `/health` (or `/health_generate`)
and `/v1/loads` (running + waiting requests, over every DP rank). Any of them failing marks the
engine UNHEALTHY with the error -- a load figure that cannot be read is not kept stale -- and a good
probe marks it healthy again. PAUSED and
DRAINING are set by operators (PauseEngines, RegisterEngine) and are never changed here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from rlfleet.common.engine_client import EngineError
from rlfleet.gateway.registry import EngineRecord, EngineRegistry, now_ms

log = logging.getLogger(__name__)

# SGLang reports "default" until a weight update names a version: that is the initial policy, 0.
INITIAL_VERSIONS = ("", "default")


def parse_version(weight_version: str) -> int:
    """rlfleet policy versions are integers carried as strings; -1 when the engine's is not one."""
    text = weight_version.strip()
    if text in INITIAL_VERSIONS:
        return 0
    try:
        return int(text)
    except ValueError:
        return -1


class HealthChecker:
    def __init__(self, registry: EngineRegistry, interval_s: float, generate_probe: bool,
                 after_round=None) -> None:
        self.registry = registry
        self.after_round = after_round  # awaited after each round (the admission advert)
        self.interval_s = interval_s
        self.generate_probe = generate_probe
        self._task: asyncio.Task | None = None
        self._stopping = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="engine-health")

    async def stop(self) -> None:
        # An event, not only cancel(): a client library that swallows the CancelledError of a probe
        # in flight would otherwise leave the loop running and the shutdown waiting on it.
        self._stopping.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        """Probes every interval, the first one an interval after start (the app probes before serving)."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.interval_s)
            if self._stopping.is_set():
                return
            try:
                await self.check_all()
            except Exception:  # Redis hiccup: log and try again next interval rather than stop probing
                if not self._stopping.is_set():
                    log.exception("engine health round failed")

    async def check_all(self) -> None:
        await self.registry.refresh()
        await asyncio.gather(*(self.check(record) for record in list(self.registry.engines.values())))
        if self.after_round is not None:
            await self.after_round()

    async def check(self, record: EngineRecord) -> None:
        client = self.registry.client(record)
        try:
            # The version call first: when the engine is down, its error says why (refused, timeout...).
            version = await client.weight_version()
            if not await client.health(generate=self.generate_probe):
                raise EngineError(f"{record.url} failed its health check", url=record.url)
            in_flight = _in_flight(await client.load())
        except EngineError as exc:
            # Which call failed: a 4xx carries only the engine's message (e.g. a 404 for a route it lacks).
            error = exc.message if exc.url in exc.message else f"{exc.url}: {exc.message}"
            if record.healthy:
                log.warning("engine unhealthy", extra={"engine_id": record.engine_id, "error": error})
            await self.registry.update(record.engine_id, healthy=False, last_error=error[:1000],
                                       last_health_ms=now_ms())
            return
        if not record.healthy:
            log.info("engine healthy", extra={"engine_id": record.engine_id, "weight_version": version})
        policy_version = parse_version(version)
        error = "" if policy_version >= 0 else f"weight_version {version!r} is not an integer policy version"
        await self.registry.update(record.engine_id, healthy=True, policy_version=policy_version,
                                   in_flight=in_flight, last_error=error, last_health_ms=now_ms())


def _in_flight(load: dict) -> int:
    return int(load.get("num_running_reqs", 0)) + int(load.get("num_waiting_reqs", 0))
