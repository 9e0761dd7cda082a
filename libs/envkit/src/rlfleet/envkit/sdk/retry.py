"""Retrying on purpose: backpressure (RESOURCE_EXHAUSTED) and unreachable peers, with capped backoff."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from rlfleet.envkit.sdk.errors import Backpressure, PeerUnavailable

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    first_s: float = 0.1
    max_s: float = 5.0
    factor: float = 2.0
    give_up_after_s: float = 600.0  # then the last error is raised

    def delays(self):
        delay = self.first_s
        while True:
            yield delay * random.uniform(0.5, 1.0)  # jitter, so refused workers do not retry in step
            delay = min(delay * self.factor, self.max_s)


async def retry(call: Callable[[], Awaitable[T]], backoff: Backoff,
                retry_on: tuple[type[BaseException], ...] = (Backpressure, PeerUnavailable),
                on_retry: Callable[[BaseException], None] | None = None) -> T:
    """`await call()`, retried after `retry_on` errors until `backoff.give_up_after_s` has passed."""
    deadline = time.monotonic() + backoff.give_up_after_s
    for delay in backoff.delays():
        try:
            return await call()
        except retry_on as exc:
            if time.monotonic() + delay > deadline:
                raise
            if on_retry is not None:
                on_retry(exc)
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")
