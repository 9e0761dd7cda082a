"""The warm pool never blocks a taker and refills in the background."""

from __future__ import annotations

import asyncio
import itertools

from rlfleet.sandbox.pool import WarmPool


async def test_take_returns_none_when_empty_and_the_pool_refills_to_its_size():
    counter = itertools.count()
    discarded: list[int] = []

    async def make() -> int:
        return next(counter)

    async def discard(item: int) -> None:
        discarded.append(item)

    pool = WarmPool(2, make, discard)
    assert pool.take() is None  # not started: empty, and no waiting
    pool.start()
    await pool.wait_full(timeout_s=2)
    assert pool.take() == 0
    await pool.wait_full(timeout_s=2)
    assert len(pool) == 2
    await pool.close()
    assert sorted(discarded) == [1, 2]
    assert len(pool) == 0


async def test_a_failing_refill_is_retried_without_spinning():
    calls = 0

    async def make() -> int:
        nonlocal calls
        calls += 1
        raise RuntimeError("no capacity")

    async def discard(item: int) -> None:
        pass

    pool = WarmPool(1, make, discard)
    pool.start()
    await asyncio.sleep(0.3)
    assert calls == 1  # backs off for a second after a failure
    assert pool.take() is None
    await pool.close()
