"""The feeder counts what is in flight off TASKS itself (a real nats-server): a task leaves the count
when its worker acks or dead-letters it, whatever its trajectories look like, and not before."""

import asyncio

import pytest

from rlfleet.api.common.v1 import common_pb2
from rlfleet.cli.loop_parts import Feeder
from rlfleet.common.config import NatsConfig
from rlfleet.common.processes import eventually
from rlfleet.common.streams import connect_nats, ensure_streams
from rlfleet.common.testing import unique_run_id
from rlfleet.envkit.task_queue import TaskQueue

pytestmark = pytest.mark.integration


async def test_in_flight_is_what_workers_have_not_acked_or_dead_lettered_and_the_feeder_tops_it_up(nats_url):
    nc = await connect_nats(NatsConfig(url=nats_url), "test-feeder")
    js = nc.jetstream()
    await ensure_streams(js, ("TASKS",))
    run_id, other_run = unique_run_id("feed"), unique_run_id("feed-other")
    tasks = [common_pb2.Task(task_id=f"t{i}", run_id=run_id) for i in range(3)]
    feeder = Feeder(js, run_id, tasks, attempt="a1")
    await Feeder(js, other_run, tasks, attempt="a1").publish(2)  # another run's tasks are not ours
    queue = TaskQueue(js, run_id, "workers", ack_wait_s=30.0, max_deliver=3)
    await queue.start()
    try:
        await feeder.publish(3)
        assert await feeder.in_flight() == 3
        acked = await queue.next(2)
        await acked.ack()
        assert await feeder.in_flight() == 2
        dead = await queue.next(2)
        await dead.dead_letter("s0: closed FAILED")  # no complete group on TRAJECTORIES, yet finished

        async def in_flight_is(n: int) -> bool:
            return await feeder.in_flight() == n

        await eventually(lambda: in_flight_is(1), within_s=10)  # a term is not confirmed: soon, not at once
        held = await queue.next(2)  # running, or its worker died holding it: in flight either way
        assert held is not None and await feeder.in_flight() == 1

        stop = asyncio.Event()
        topping = asyncio.create_task(feeder.keep_topped_up(4, stop))
        try:
            await eventually(lambda: in_flight_is(4), within_s=10)
            await asyncio.sleep(0.5)  # and no more than that
            assert feeder.published == 6 and await feeder.in_flight() == 4
        finally:
            stop.set()
            await topping
        await held.ack()
    finally:
        await queue.stop()
        await nc.close()


async def test_the_feeder_hands_out_no_more_than_the_room_ahead_of_the_trainer_allows(nats_url):
    nc = await connect_nats(NatsConfig(url=nats_url), "test-feeder-ahead")
    js = nc.jetstream()
    await ensure_streams(js, ("TASKS",))
    run_id = unique_run_id("feed-ahead")
    tasks = [common_pb2.Task(task_id=f"t{i}", run_id=run_id) for i in range(3)]
    feeder = Feeder(js, run_id, tasks, attempt="a1")
    backlog = {"groups": 3}  # groups' worth of samples waiting for the trainer
    asked: list[int] = []

    async def room_ahead(groups_in_tasks: int) -> int:
        asked.append(groups_in_tasks)
        return 5 - backlog["groups"] - groups_in_tasks  # at most 5 groups ahead of the trainer

    async def in_flight_is(n: int) -> bool:
        return await feeder.in_flight() == n

    stop = asyncio.Event()
    topping = asyncio.create_task(feeder.keep_topped_up(4, stop, room_ahead))
    try:
        await eventually(lambda: in_flight_is(2), within_s=10)
        await asyncio.sleep(0.6)  # the trainer's backlog leaves room for 2, not for the 4 wanted
        assert feeder.published == 2 and asked[-1] == 2
        backlog["groups"] = 0  # the trainer caught up: the in-flight target bounds it again
        await eventually(lambda: in_flight_is(4), within_s=10)
        await asyncio.sleep(0.6)
        assert feeder.published == 4
    finally:
        stop.set()
        await topping
        await nc.close()
