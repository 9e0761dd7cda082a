"""A warm pool: keep up to `size` ready-made items, refilled in the background.

`take()` never waits: it returns a ready item or None, and the caller makes one itself. So the pool
only ever moves work off the request path; it cannot add latency or deadlock when it runs dry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

# After a failed refill (e.g. every uid in use), wait before trying again instead of spinning.
_RETRY_AFTER_S = 1.0


class WarmPool(Generic[T]):
    def __init__(
        self, size: int, make: Callable[[], Awaitable[T]], discard: Callable[[T], Awaitable[None]]
    ) -> None:
        if size < 0:
            raise ValueError("pool size must be >= 0")
        self.size = size
        self._make, self._discard = make, discard
        self._ready: deque[T] = deque()
        self._wanted = asyncio.Event()  # someone took an item: refill
        self._full = asyncio.Event()  # holds `size` items
        if size == 0:
            self._full.set()
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._ready)

    def take(self) -> T | None:
        item = self._ready.popleft() if self._ready else None
        self._full.clear()
        self._wanted.set()
        return item

    def start(self) -> None:
        if self.size and self._task is None:
            self._wanted.set()
            self._task = asyncio.create_task(self._refill(), name="sandbox-warm-pool")

    async def wait_full(self, timeout_s: float = 10.0) -> None:
        """For tests and benchmarks: until the pool holds `size` items."""
        async with asyncio.timeout(timeout_s):
            await self._full.wait()

    async def _refill(self) -> None:
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            while len(self._ready) < self.size:
                try:
                    self._ready.append(await self._make())
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.warning("warm pool refill failed; retrying in %.1fs", _RETRY_AFTER_S, exc_info=True)
                    await asyncio.sleep(_RETRY_AFTER_S)
                # Let request handlers run between items: refilling is background work.
                await asyncio.sleep(0)
            self._full.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        while self._ready:
            await self._discard(self._ready.popleft())
