"""Real `rlfleet-controller` processes sharing one run through the store (the harness's NATS), each
with a run directory of its own: a controller SIGKILLed mid-run is continued by another, which had
no run_state.json, with the run's counts, accepted version and gate position; a second controller
is refused while the first holds the run; a fresh run replaces the stored one.

The platform's other services are not started: their addresses lead nowhere, so the loop the
controllers resume waits on the gateway (its calls retried, as on a platform restarting), which
is all this needs: the run is claimed, driven and held.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import grpc
import pytest

from rlfleet.api.controller.v1 import controller_pb2, controller_pb2_grpc
from rlfleet.cli.launcher import start_ticks
from rlfleet.cli.report import EvalResult, GateDecision, RunRecord, StepRecord
from rlfleet.cli.run_config import RunConfig
from rlfleet.cli.run_state import STATE_FILE, RunState, host_identity
from rlfleet.common.config import NatsConfig
from rlfleet.common.grpc_server import blocking_channel
from rlfleet.common.processes import ServiceProcess, free_port, wait_until
from rlfleet.common.streams import connect_nats, ensure_streams
from rlfleet.common.testing import unique_run_id, without_login
from rlfleet.controller.config import RunStoreConfig
from rlfleet.controller.state_store import Owner, RunStore, Snapshot

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def controller_nats(nats_url: str, infra_secrets) -> dict:
    return {"url": without_login(nats_url), **infra_secrets.nats["controller"].nats()}


def start_controller(workdir: Path, run_id: str, nats: dict, name: str, **extra) -> ServiceProcess:
    """A controller whose run directory is its own and whose peers are nowhere (see the docstring)."""
    nowhere = f"127.0.0.1:{free_port()}"
    peers = ("gateway", "trainer", "broker", "verifier", "session", "sandbox")
    config = {"run_id": run_id, "run_dir": str(workdir / name / "run"), "nats": nats,
              "metrics.enabled": False, **{f"{peer}_address": nowhere for peer in peers}, **extra}
    return ServiceProcess("rlfleet-controller", workdir / name, config=config, name=name).start(120)


def run_config(run_id: str, run_dir: Path) -> RunConfig:
    return RunConfig(run_id=run_id, run_dir=str(run_dir), audit={"enabled": False}, eval={"heldout": 4,
                                                                                           "regression": 0})


def seeded_state(run_id: str, run_dir: Path) -> RunState:
    """A run some 95 s into its loop: 7 steps, two gate decisions (version 5 accepted), 40 tasks
    handed out, its verifier audit passed before the loop."""
    config = run_config(run_id, run_dir).model_dump(mode="json")
    record = RunRecord(run_id, "async", config, time.time(), accepted_version=5)
    record.steps += [StepRecord(step=v, version=v, elapsed_s=10.0 * v, reward_mean=0.5) for v in range(1, 8)]
    record.gate += [GateDecision(3, False, ["no gain"], 40.0), GateDecision(5, True, ["held-out +0.2"], 60.0)]
    record.audits.append({"when": "before the loop", "breaches": []})
    accepted = EvalResult(5, "heldout", 4, 0.75, 0.0, 0.0, 1.0, 2.0, 60.0, "candidate")
    return RunState("running", config, "seeded-attempt", loop_s=95.0, tasks_published=40, last_gated=5,
                    accepted_version=5, accepted_eval=asdict(accepted), driven_by="controller",
                    record=asdict(record))


def a_dead_owner() -> Owner:
    """A controller process of this machine that is gone (killed mid-save, say)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    owner = Owner("seeded", host_identity(), proc.pid, start_ticks(proc.pid) or 0)
    proc.kill()
    proc.wait(10)
    return owner


async def store_as_controller(nats_url: str, infra_secrets, run_id: str,
                              owner: Owner | None = None) -> RunStore:
    nc = await connect_nats(NatsConfig(**controller_nats(nats_url, infra_secrets)), "t-seed")
    store = await RunStore.open(nc.jetstream(), run_id, RunStoreConfig(mirror=False))
    store.nc = nc  # type: ignore[attr-defined]  # closed by `stored`
    if owner is not None:
        store.owner = owner
    return store


def stored(nats_url: str, infra_secrets, run_id: str) -> Snapshot:
    async def read() -> Snapshot:
        store = await store_as_controller(nats_url, infra_secrets, run_id)
        try:
            return await store.read()
        finally:
            await store.nc.close()  # type: ignore[attr-defined]

    return asyncio.run(read())


def get_run(controller: ServiceProcess) -> controller_pb2.RunInfo | None:
    with blocking_channel(controller.address) as channel:
        try:
            stub = controller_pb2_grpc.RunControlStub(channel)
            return stub.GetRun(controller_pb2.GetRunRequest(), timeout=10)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise


def start_run(controller: ServiceProcess, config: RunConfig, **flags: bool) -> controller_pb2.RunInfo:
    with blocking_channel(controller.address) as channel:
        config_json = json.dumps(config.model_dump(mode="json"))
        request = controller_pb2.StartRunRequest(config_json=config_json, **flags)
        return controller_pb2_grpc.RunControlStub(channel).StartRun(request, timeout=30)


def test_a_killed_controller_s_run_is_continued_by_another_from_the_store(tmp_path, nats_url, infra_secrets):
    run_id = unique_run_id("ctl")
    nats = controller_nats(nats_url, infra_secrets)

    async def seed() -> None:
        store = await store_as_controller(nats_url, infra_secrets, run_id, owner=a_dead_owner())
        try:
            # The platform's streams, as its services make them at start.
            await ensure_streams(store.nc.jetstream())  # type: ignore[attr-defined]
            await store.claim(seeded_state(run_id, tmp_path / "seeded-run"), await store.read())
        finally:
            await store.nc.close()  # type: ignore[attr-defined]

    asyncio.run(seed())

    first = start_controller(tmp_path, run_id, nats, "first")
    second = third = None
    try:
        # The first resumes the run it finds in the store (its holder gone from this machine).
        info = wait_until(lambda: get_run(first), 60, "the first controller resuming the stored run", first,
                          every_s=0.5)
        assert (info.accepted_version, info.steps, info.gate_decisions, info.resumes) == (5, 7, 2, 1)
        assert info.driven_by == "controller" and info.run_dir == str(tmp_path / "first" / "run")
        held = stored(nats_url, infra_secrets, run_id)
        assert held.head.owner.pid == first.pid and held.head.status == "running"

        # A second controller, elsewhere in its own run directory, is refused while the first holds it.
        second = start_controller(tmp_path, run_id, nats, "second", **{"state.lease_s": 30})
        with pytest.raises(grpc.RpcError) as refused:
            start_run(second, run_config(run_id, tmp_path / "second" / "run"), resume=True)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"pid {first.pid}" in refused.value.details()
        assert "driven by another controller" in refused.value.details()
        assert get_run(second) is None, "it waits and drives nothing"
        assert not (tmp_path / "second" / "run" / STATE_FILE).exists()

        # The first killed mid-run: the second continues it at once (the holder is gone from this
        # machine) from the store alone, with the counts, accepted version and gate where they were.
        first.kill()
        info = wait_until(lambda: get_run(second), 60, "the second controller continuing the run", second,
                          every_s=0.5)
        assert (info.accepted_version, info.steps, info.gate_decisions, info.resumes) == (5, 7, 2, 2)
        state = wait_until(lambda: (s := stored(nats_url, infra_secrets, run_id)).head.owner.pid == second.pid
                           and s, 60, "the second holding the run", second, every_s=0.5).state
        assert (state.attempt, state.tasks_published, state.last_gated, state.accepted_version) == \
               ("seeded-attempt", 40, 5, 5)
        assert state.accepted_eval["success"] == 0.75 and len(state.resumes) == 2
        assert state.record["config"]["run_dir"] == str(tmp_path / "second" / "run"), "in its own directory"
        assert (tmp_path / "second" / "run" / STATE_FILE).exists(), "its own copy, once it holds the run"

        # A fresh run (on a third controller, the second killed) replaces the stored one.
        second.kill()
        third = start_controller(tmp_path, run_id, nats, "third", resume_on_start=False)
        started = start_run(third, run_config(run_id, tmp_path / "third" / "run"), fresh=True)
        assert (started.accepted_version, started.steps, started.gate_decisions, started.resumes) == \
               (0, 0, 0, 0)
        fresh = stored(nats_url, infra_secrets, run_id)
        assert fresh.head.owner.pid == third.pid
        assert fresh.state.attempt != "seeded-attempt" and fresh.state.tasks_published == 0
        assert fresh.state.record["steps"] == [] and fresh.state.resumes == []
    finally:
        for controller in (first, second, third):
            if controller is not None:
                controller.stop(5)
