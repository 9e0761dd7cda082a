"""The TASKS queue with a real nats-server: redelivery, dead letters, nothing dropped silently."""

import asyncio

import pytest
from nats.js.errors import NotFoundError

from rlfleet.common.config import NatsConfig
from rlfleet.common.streams import connect_nats, ensure_streams, publish
from rlfleet.common.testing import unique_run_id
from rlfleet.envkit.task_queue import (
    DEAD_LETTER_STREAM,
    DELIVERIES_HEADER,
    REASON_HEADER,
    MaxDeliveriesWatch,
    TaskQueue,
    dead_letter_subject,
)

pytestmark = pytest.mark.integration


async def queue(nats_url, **options):
    nc = await connect_nats(NatsConfig(url=nats_url), "test-queue")
    js = nc.jetstream()
    await ensure_streams(js, ("TASKS",))
    run_id = unique_run_id("q")
    tasks = TaskQueue(js, run_id, "workers", **options)
    await tasks.start()
    return nc, js, run_id, tasks


async def dead_letters(js, run_id, count):
    sub = await js.subscribe(dead_letter_subject(run_id), stream=DEAD_LETTER_STREAM, ordered_consumer=True)
    return [await sub.next_msg(timeout=5) for _ in range(count)]


async def test_an_unacked_task_is_redelivered_with_its_delivery_count(nats_url):
    nc, js, run_id, tasks = await queue(nats_url, ack_wait_s=1.0, max_deliver=3)
    await publish(js, "TASKS", run_id, b"task", msg_type="t")
    first = await tasks.next(2)
    assert (first.number, first.last_chance) == (1, False)  # and then the worker dies: no ack
    second = await tasks.next(3)
    assert second.sequence == first.sequence and second.number == 2
    await second.ack()
    assert await tasks.next(1.5) is None
    await nc.close()


async def test_a_heartbeat_keeps_a_long_task_from_being_redelivered(nats_url):
    nc, js, run_id, tasks = await queue(nats_url, ack_wait_s=1.0, max_deliver=3)
    await publish(js, "TASKS", run_id, b"task", msg_type="t")
    delivery = await tasks.next(2)
    async with delivery.heartbeat(0.3):
        assert await tasks.next(2.0) is None  # 2x ack_wait later, still ours
    await delivery.ack()
    await nc.close()


async def test_a_task_that_used_its_last_delivery_is_dead_lettered_with_the_reason(nats_url):
    nc, js, run_id, tasks = await queue(nats_url, ack_wait_s=1.0, max_deliver=1)
    await publish(js, "TASKS", run_id, b"payload", msg_type="t")
    delivery = await tasks.next(2)
    assert delivery.last_chance
    await delivery.dead_letter("group g unfinished after 1 deliveries: s0: sandbox down")
    [dead] = await dead_letters(js, run_id, 1)
    assert dead.data == b"payload" and dead.headers[REASON_HEADER].startswith("group g unfinished")
    assert await tasks.next(1.5) is None  # terminated: never redelivered
    await nc.close()


async def test_a_task_whose_last_delivery_died_with_its_worker_is_dead_lettered_not_lost(nats_url):
    nc, js, run_id, tasks = await queue(nats_url, ack_wait_s=1.0, max_deliver=1)
    watch = MaxDeliveriesWatch(nc, tasks)
    await watch.start()
    await publish(js, "TASKS", run_id, b"orphan", msg_type="t")
    held = await tasks.next(2)
    assert held.last_chance  # and the worker dies holding it
    [dead] = await dead_letters(js, run_id, 1)
    assert dead.data == b"orphan" and dead.headers[DELIVERIES_HEADER] == "1"
    assert "last one was lost" in dead.headers[REASON_HEADER]
    await asyncio.sleep(0.2)
    with pytest.raises(NotFoundError):  # moved, not copied: TASKS no longer holds it
        await js.get_msg("TASKS", held.sequence)
    await watch.stop()
    await nc.close()
