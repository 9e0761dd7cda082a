"""The run's state in JetStream KV, against the harness's real (secured) nats-server, logged in as
the controller: saved in parts past NATS's message limit, claimed by one controller at a time, taken
over once the holder is gone or its lease lapsed, and read once from an older run directory."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from dataclasses import asdict, replace

import nats.js.errors
import pytest

from rlfleet.cli.launcher import start_ticks
from rlfleet.cli.report import GateDecision, RunRecord, StepRecord
from rlfleet.cli.run_state import STATE_FILE, RunState, host_identity
from rlfleet.common.config import NatsConfig
from rlfleet.common.streams import connect_nats
from rlfleet.common.testing import unique_run_id, without_login
from rlfleet.controller.config import RunStoreConfig
from rlfleet.controller.state_store import Owner, RunHeld, RunStore, RunTakenOver

pytestmark = pytest.mark.integration


@pytest.fixture
async def controller_nats(nats_url, infra_secrets):
    """NATS as the controller's own user (its subject permissions), as the service connects."""
    login = infra_secrets.nats["controller"].nats()
    nc = await connect_nats(NatsConfig(url=without_login(nats_url), **login), "t-controller")
    yield nc
    await nc.close()


def a_state(tasks: int = 40, accepted: int = 5, notes: tuple[str, ...] = (), run_id: str = "r") -> RunState:
    record = RunRecord(run_id, "async", {"run_id": run_id}, 1.0, accepted_version=accepted, notes=list(notes))
    record.steps += [StepRecord(step=v, version=v, elapsed_s=2.0 * v, reward_mean=0.5) for v in range(1, 8)]
    record.gate.append(GateDecision(accepted, True, ["held-out success +0.1"], 10.0))
    return RunState("running", {"run_id": run_id}, "att", loop_s=95.0, tasks_published=tasks,
                    last_gated=accepted, accepted_version=accepted, driven_by="controller",
                    record=asdict(record))


async def store_of(nc, run_id: str, tmp_path, name: str, owner: Owner | None = None, **config) -> RunStore:
    store = await RunStore.open(nc.jetstream(), run_id, RunStoreConfig(**config), tmp_path / name)
    if owner is not None:
        store.owner = owner
    return store


@pytest.fixture
def live_process():
    """Another live process on this machine, standing in for a controller that holds a run."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait(10)


def owner_of(proc: subprocess.Popen, host: str | None = None) -> Owner:
    return Owner(f"o{proc.pid}", host or host_identity(), proc.pid, start_ticks(proc.pid) or 0)


async def test_a_state_larger_than_a_nats_message_is_stored_in_parts_and_read_back_whole(controller_nats,
                                                                                         tmp_path):
    run_id = unique_run_id("state")
    big = os.urandom(1_500_000).hex()  # 3 MB of JSON that compression cannot shrink below 1 MB
    store = await store_of(controller_nats, run_id, tmp_path, "a", part_bytes=256 * 1024)
    snapshot = await store.read()
    assert snapshot.state is None and snapshot.revision == 0
    await store.claim(a_state(notes=(big,)), snapshot)
    await store.save(a_state(tasks=41, notes=(big,)))

    back = await (await store_of(controller_nats, run_id, tmp_path, "b")).read()
    assert back.state is not None and back.state.tasks_published == 41
    assert back.state.record["notes"] == [big]
    assert back.head is not None and back.head.parts > 4 and back.head.size > 1_000_000
    assert (tmp_path / "a" / STATE_FILE).exists(), "the copy in the run directory"
    assert not (tmp_path / "b" / STATE_FILE).exists(), "a reader writes nothing"


async def test_a_second_controller_is_refused_while_the_first_holds_the_run(controller_nats, tmp_path,
                                                                            live_process):
    run_id = unique_run_id("state")
    first = await store_of(controller_nats, run_id, tmp_path, "a", owner=owner_of(live_process))
    await first.claim(a_state(), await first.read())

    second = await store_of(controller_nats, run_id, tmp_path, "b")
    snapshot = await second.read()
    with pytest.raises(RunHeld, match=f"pid {live_process.pid}") as held:
        await second.claim(a_state(tasks=99), snapshot)
    assert held.value.details["holder_pid"] == live_process.pid and held.value.retry_after_s <= 1.0
    assert (await second.read()).state.tasks_published == 40, "the refused controller wrote nothing"

    # The holder's process gone from this machine: taken over at once, its lease notwithstanding.
    live_process.kill()
    live_process.wait(10)
    snapshot = await second.read()
    await second.claim(replace(snapshot.state, tasks_published=41), snapshot)
    with pytest.raises(RunTakenOver):
        await first.save(a_state(tasks=1000))  # had it not died: it learns it lost the run, writes nothing
    with pytest.raises(RunTakenOver):
        await first.renew()
    after = await second.read()
    assert after.state.tasks_published == 41 and after.head.owner == second.owner
    with pytest.raises(nats.js.errors.KeyNotFoundError):  # the first holder's parts are gone
        await first.kv.get(first.key(f"{first.owner.id}.a", "0"))


async def test_a_controller_on_another_machine_is_taken_over_only_once_its_lease_lapsed(
        controller_nats, tmp_path, live_process):
    run_id = unique_run_id("state")
    elsewhere = owner_of(live_process, host="node-7/boot/pid:[1]")
    first = await store_of(controller_nats, run_id, tmp_path, "a", owner=elsewhere, lease_s=3.0)
    await first.claim(a_state(), await first.read())
    await first.renew()

    second = await store_of(controller_nats, run_id, tmp_path, "b")
    with pytest.raises(RunHeld, match="node-7") as held:
        second.check_free(await second.read())
    assert 2.0 < held.value.retry_after_s <= 3.5, "told to come back when the lease lapses"
    await asyncio.sleep(held.value.retry_after_s)
    snapshot = await second.read()
    await second.claim(snapshot.state, snapshot)
    assert (await second.read()).head.owner == second.owner


async def test_a_run_that_ended_is_free_to_claim_and_its_parts_are_replaced(controller_nats, tmp_path,
                                                                            live_process):
    run_id = unique_run_id("state")
    first = await store_of(controller_nats, run_id, tmp_path, "a", owner=owner_of(live_process))
    await first.claim(a_state(), await first.read())
    await first.save(replace(a_state(), status="interrupted", reason="stopped by a request"))

    second = await store_of(controller_nats, run_id, tmp_path, "b")
    snapshot = await second.read()
    fresh = RunState("running", {"run_id": run_id}, "new-attempt", driven_by="controller")
    await second.claim(fresh, snapshot)  # the holder lives, but its run stopped: no lease to respect
    back = await (await store_of(controller_nats, run_id, tmp_path, "c")).read()
    assert back.state.attempt == "new-attempt" and back.state.tasks_published == 0 and back.state.record == {}
    assert back.head.slots == {f"{second.owner.id}.a": 1}


async def test_a_run_directory_from_before_the_store_is_read_once_then_the_store_holds_it(controller_nats,
                                                                                          tmp_path):
    run_id = unique_run_id("state")
    older = tmp_path / "older"
    older.mkdir()
    a_state(tasks=17, run_id=run_id).save(older)  # run_state.json as `rlfleet run` wrote it before the store
    store = await store_of(controller_nats, run_id, tmp_path, "older")
    snapshot = await store.read()
    assert snapshot.state.tasks_published == 17 and snapshot.head is None
    assert snapshot.where.endswith(STATE_FILE)
    await store.claim(snapshot.state, snapshot)

    elsewhere = await (await store_of(controller_nats, run_id, tmp_path, "new")).read()
    assert elsewhere.state.tasks_published == 17 and "JetStream KV" in elsewhere.where
    other = await (await store_of(controller_nats, unique_run_id("state"), tmp_path, "older")).read()
    assert other.state is None, "another run's run_state.json is not taken for this run's"


async def test_saves_renew_the_lease_and_keep_two_generations_at_most(controller_nats, tmp_path):
    run_id = unique_run_id("state")
    store = await store_of(controller_nats, run_id, tmp_path, "a")
    await store.claim(a_state(), await store.read())
    for tasks in range(41, 45):
        before = time.time()
        await store.save(a_state(tasks=tasks))
        head = (await store.read()).head
        assert head.renewed_unix >= before and head.generation == tasks - 39
    assert sorted(head.slots) == [f"{store.owner.id}.a", f"{store.owner.id}.b"]
