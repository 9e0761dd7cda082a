"""An interrupted `rlfleet run` resumes from its run directory without losing or retraining trajectories.

One run is interrupted twice: by Ctrl-C (SIGINT to the driver), then by the trainer dying (SIGKILL,
mid-step). Each time `rlfleet run CONFIG --resume` goes on from the trainer's last checkpoint. The
last resume leaves the platform up (`--keep-up`), so the test can read the trainer's ledger and the
TRAJECTORIES stream, then attaches a further resume to the running platform.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlfleet.common.grpc_server import blocking_channel
from rlfleet.common.testing import BackgroundRun

# Its own warm start (SFT) alone took 3 minutes at a load of ~12 here: the suite's 300 s limit cut a
# run that was going well.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]

RLFLEET = str(Path(sys.executable).parent / "rlfleet")

CONFIG = """
run_id = "resume"
group_size = 4
[model]
hidden_size = 64
num_hidden_layers = 2
[warm_start]
demonstrations = 400
epochs = 2
lr = 3e-3
[rollout]
concurrency = 8
# Bound far above what a few steps reach: the test counts every learnable trajectory as owed to
# training, and a stale one is (rightly) dropped instead.
max_staleness = 1000
[trainer]
groups_per_step = 2
[trainer.optim]
lr = 1e-4
[eval]
heldout = 16
regression = 0
[gate]
every_versions = 2
[budget]
max_steps = {steps}
max_minutes = 4
# A restarted trainer gets its predecessor's unacked trajectories back after the consumer's ack
# wait (60 s by default, held ones are kept alive by heartbeats): short here, so the redelivered
# ones are trained within this short run.
[trainer.consumer]
ack_wait_s = 6
"""


def Driver(*args: str) -> BackgroundRun:
    """`rlfleet run` in the background."""
    return BackgroundRun([RLFLEET, "run", *args])


def _steps(run_dir: Path) -> int:
    """The newest version the trainer has checkpointed (it checkpoints every step). Read from its
    checkpoints, not the driver's state file: that is rewritten every 10 s, in which a fast loop can
    run to the end of its budget."""
    from rlfleet.trainer.checkpointer import Checkpointer

    root = run_dir / "checkpoints" / "resume"
    try:
        restored = Checkpointer(root).latest() if root.is_dir() else None  # the trainer makes the directory
    except OSError:  # the run started over under us
        return 0
    return max((r.version for r in restored.ledger.records()), default=0) if restored else 0


def _wait_for_steps(driver: Driver, run_dir: Path, n: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while _steps(run_dir) < n:
        assert driver.proc.poll() is None, driver.output()[-3000:]
        assert time.monotonic() < deadline, \
            f"fewer than {n} steps after {timeout} s:\n" + driver.output()[-3000:]
        time.sleep(1)


def _ledger(run_dir: Path) -> list[tuple[int, list[str]]]:
    from rlfleet.trainer.checkpointer import Checkpointer

    restored = Checkpointer(run_dir / "checkpoints" / "resume").latest()
    assert restored is not None, "no checkpoint"
    return [(r.version, list(r.ids)) for r in restored.ledger.records()]


async def _train_trajectories(nats_url: str, run_dir) -> list[tuple[float, object]]:
    """Every train-split trajectory in TRAJECTORIES, with the time it was published."""
    import nats
    from nats.js.api import DeliverPolicy

    from rlfleet.api.common.v1 import common_pb2
    from rlfleet.common.config import NatsConfig
    from rlfleet.common.infra_auth import run_dir_login
    from rlfleet.common.streams import connect_nats, subject

    nc = await connect_nats(NatsConfig(url=nats_url, **run_dir_login(run_dir, "nats", "operator")), "itest")
    found = []
    try:
        js = nc.jetstream()
        sub = await js.subscribe(subject("TRAJECTORIES", "resume"), ordered_consumer=True,
                                 deliver_policy=DeliverPolicy.ALL)
        while True:
            try:
                msg = await sub.next_msg(timeout=2)
            except nats.errors.TimeoutError:
                break
            traj = common_pb2.Trajectory.FromString(msg.data)
            if (traj.split or "train") == "train":
                found.append((msg.metadata.timestamp.timestamp(), traj))
        await sub.unsubscribe()
    finally:
        await nc.close()
    return found


async def _stored_state(nats_url: str, run_dir: Path):
    """The run's state as the controller keeps it: JetStream KV, read with the controller's login."""
    from rlfleet.cli.run_state import RunState
    from rlfleet.common.config import NatsConfig
    from rlfleet.common.infra_auth import run_dir_login
    from rlfleet.common.streams import connect_nats
    from rlfleet.controller.config import RunStoreConfig
    from rlfleet.controller.state_store import RunStore

    nc = await connect_nats(NatsConfig(url=nats_url, **run_dir_login(run_dir, "nats", "controller")), "itest")
    try:
        store = await RunStore.open(nc.jetstream(), "resume", RunStoreConfig(mirror=False))
        snapshot = await store.read()
        assert isinstance(snapshot.state, RunState), snapshot
        return snapshot
    finally:
        await nc.close()


def _trainer_drops(run_dir: Path) -> dict[str, int]:
    from rlfleet.api.trainer.v1 import trainer_pb2, trainer_pb2_grpc

    address = next(p["address"] for p in json.loads((run_dir / "platform.json").read_text())["processes"]
                   if p["name"] == "trainer")
    with blocking_channel(address) as channel:
        status = trainer_pb2_grpc.TrainerServiceStub(channel).GetStatus(trainer_pb2.GetStatusRequest(),
                                                                        timeout=10)
    return dict(status.dropped_by_reason)


def test_an_interrupted_run_resumes_from_its_run_directory(tmp_path):
    from rlfleet.api.common.v1 import common_pb2

    config = tmp_path / "resume.toml"
    config.write_text(CONFIG.format(steps=30))
    run_dir = tmp_path / "run"
    common = ["--run-dir", str(run_dir), "--model-cache-dir", str(tmp_path / "cache")]

    # 1. Ctrl-C: the driver stops the loop, checkpoints, writes its state and report, and says how to go on.
    first = Driver(str(config), *common)
    _wait_for_steps(first, run_dir, 2, timeout=600)
    first.proc.send_signal(signal.SIGINT)
    assert first.wait(180) == 130, first.output()[-3000:]
    assert "--resume" in first.output()
    state = json.loads((run_dir / "run_state.json").read_text())
    assert state["status"] == "interrupted" and state["reason"] == "stopped by a signal"
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    steps_at_sigint = _ledger(run_dir)[-1][0]
    assert steps_at_sigint >= 2

    # A new run in the same directory is refused rather than silently replacing the interrupted one.
    refused = subprocess.run([RLFLEET, "run", str(config), *common], capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode != 0 and "--resume" in refused.stderr + refused.stdout

    # 2. Resume with restarts off; then the trainer dies mid-run (SIGKILL): the driver notices and
    # stops as interrupted (with restarts on, the default, it would start the trainer again: test_chaos.py).
    second = Driver(str(config), *common, "--resume", "--restart.enabled", "false")
    _wait_for_steps(second, run_dir, _steps(run_dir) + 2)
    trainer = next(p for p in json.loads((run_dir / "platform.json").read_text())["processes"]
                   if p["name"] == "trainer")
    os.kill(trainer["pid"], signal.SIGKILL)
    killed_at = time.time()
    assert second.wait(240) == 1
    assert "trainer stopped running" in second.output(), second.output()[-3000:]
    before_kill = {i for _, ids in _ledger(run_dir) for i in ids}

    # 3. Resume to the end of the budget, leaving the platform up to look at it.
    third = Driver(str(config), *common, "--resume", "--keep-up")
    try:
        assert third.wait(600) == 0, third.output()[-3000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "finished"
        assert summary["final_version"] >= 30
        assert any(g["label"] == "final" for g in summary["heldout_curve"])

        ledger = _ledger(run_dir)
        versions = [v for v, _ in ledger]
        assert versions == list(range(1, len(versions) + 1)), "a step is missing from the ledger"
        trained = [i for _, ids in ledger for i in ids]
        assert len(trained) == len(set(trained)), "a trajectory was trained twice"
        assert before_kill <= set(trained), "the checkpointed steps were lost"

        # Nothing published before the trainer was killed is lost: every learnable trajectory of a
        # complete group (rewards not all equal: GRPO drops the others) was trained after the resume.
        nats_url = next(p["url"] for p in json.loads((run_dir / "platform.json").read_text())["processes"]
                        if p["name"] == "nats")
        published = asyncio.run(_train_trajectories(nats_url, run_dir))
        groups: dict[str, list] = {}
        for at, traj in published:
            groups.setdefault(traj.group_id, []).append((at, traj))
        finished = (common_pb2.TRAJECTORY_STATUS_COMPLETED, common_pb2.TRAJECTORY_STATUS_TRUNCATED)
        owed = set()
        for members in groups.values():
            done = [t for _, t in members if t.status in finished]
            if (len(members) == members[0][1].group_size and len(done) >= 2
                    and len({t.verdict.reward for t in done}) > 1
                    and max(at for at, _ in members) < killed_at):
                owed |= {t.trajectory_id for t in done}
        assert owed, "no learnable group was published before the kill"
        lost = owed - set(trained)
        assert not lost, f"{len(lost)} of {len(owed)} trajectories published before the kill were not " \
                         f"trained (trainer drops: {_trainer_drops(run_dir)})"

        # The run's state is the store's (JetStream KV); run_state.json is the controller's copy of it.
        stored = asyncio.run(_stored_state(nats_url, run_dir))
        copy = json.loads((run_dir / "run_state.json").read_text())
        assert stored.head.status == stored.state.status == copy["status"] == "finished"
        state = stored.state
        assert (state.attempt, state.tasks_published, state.accepted_version, len(state.resumes)) == \
               (copy["attempt"], copy["tasks_published"], copy["accepted_version"], 2)

        # 4. Another resume with a bigger budget attaches to the platform that is still up.
        config.write_text(CONFIG.format(steps=34))
        fourth = Driver(str(config), *common, "--resume")
        assert fourth.wait(600) == 0, fourth.output()[-3000:]
        assert "attached to the one running" in fourth.output()
        assert json.loads((run_dir / "summary.json").read_text())["final_version"] >= 34
    finally:
        subprocess.run([RLFLEET, "down", "--run-dir", str(run_dir)], capture_output=True, timeout=120)
