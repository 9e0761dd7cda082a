"""What the RL loop's parts share (the driver, the promotion gate, the stop-rule checks, the watch):
the run's config, record, clock and stop, the accepted version's evaluations, and how a part calls
a platform service."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from rlfleet.api.broker.v1 import broker_pb2, broker_pb2_grpc
from rlfleet.cli.loop_parts import Clock
from rlfleet.cli.report import EvalResult, RunRecord
from rlfleet.cli.run_config import RunConfig

log = logging.getLogger(__name__)

T = TypeVar("T")


class Stopped(Exception):
    """The run's stop was set while waiting for something that no longer matters."""


def say(text: str) -> None:
    print(text, flush=True)


@dataclass
class LoopContext:
    """The run's shared state. One object, handed to each part of the loop, so that a part reads
    the same clock, record and accepted evaluations the driver saves and resumes."""

    config: RunConfig
    run_dir: Path
    record: RunRecord
    say: Callable[[str], None] = say  # where the run's progress lines go (the controller streams them)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    clock: Clock = field(default_factory=Clock)
    accepted_eval: EvalResult | None = None       # the accepted version's held-out evaluation
    accepted_regression: EvalResult | None = None  # and its regression one, when there is a set
    last_gated: int = 0                            # the last version the gate decided on
    interrupted: str = ""  # why the loop stopped before its budget, when it did
    # the trainer's dropped trajectories by reason (its /metrics)
    trainer_dropped: dict[str, float] = field(default_factory=dict)

    async def unless_stopped(self, work: Awaitable[T]) -> T:
        """`await work`, abandoned (cancelled, `Stopped` raised) as soon as the stop is set: an
        orderly stop never waits for an evaluation to run out its retries."""
        task = asyncio.ensure_future(work)
        stopping = asyncio.ensure_future(self.stop.wait())
        try:
            await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(task, 30.0)  # its episodes abort their sessions, each bounded
        raise Stopped


RPC_TIMEOUT_S = 10.0
PLATFORM_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


async def rpc(method: Callable[..., Any], request: Any, *, timeout_s: float = RPC_TIMEOUT_S,
              within_s: float = 120.0) -> Any:
    """One call to a platform service, with a deadline. A peer that is down or restarting
    (UNAVAILABLE, DEADLINE_EXCEEDED) is called again with backoff bounded to 2 s, for `within_s` at
    most (the supervisor brings it back meanwhile); any other status is raised at once."""
    deadline = time.monotonic() + within_s
    delay = 0.25
    while True:
        try:
            return await method(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in PLATFORM_CODES or time.monotonic() + delay > deadline:
                raise
        await asyncio.sleep(delay)
        delay = min(delay * 2, 2.0)


async def wait_served(broker: broker_pb2_grpc.BrokerServiceStub, version: int, pool: str, *,
                      timeout_s: float, stop: asyncio.Event | None = None) -> bool:
    """Whether every engine of `pool` serves `version` (or a newer one) within `timeout_s`, as the
    broker reports; False at once when `stop` is set."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
        status = await rpc(broker.GetStatus, broker_pb2.GetStatusRequest())
        engines = [e for e in status.engines if e.pool == pool]
        if engines and all(e.policy_version >= version for e in engines):
            return True
        await asyncio.sleep(0.1)
    return False


async def stopped(task: asyncio.Task, what: str, timeout_s: float = 90.0,
                  say: Callable[[str], None] = say) -> None:
    """Waits for a background task that was told to stop; one that failed says so (never silently),
    one that does not stop in time is cancelled."""
    try:
        await asyncio.wait_for(asyncio.shield(task), timeout_s)
    except TimeoutError:
        task.cancel()
        say(f"{what} did not stop within {timeout_s:.0f} s; cancelled it")
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    except asyncio.CancelledError:
        if not task.done():
            task.cancel()
        raise
    except Exception as exc:  # reported, not swallowed
        say(f"{what} failed: {type(exc).__name__}: {exc}")
        log.error("%s failed", what, exc_info=exc)
