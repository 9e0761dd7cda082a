"""Kill -9 the trainer at random moments; every published trajectory is trained exactly once.
"torch-ppo": PPO with a separate critic, whose own checkpoint (inside the trainer's) must then hold
exactly one critic step per trained step too. "torch-lora": a LoRA adapter, whose checkpoints hold the
adapter only and whose versions after the base are adapter versions. "torch-standby": each restart is a
standby trainer (started beside the live one, its imports done) promoted, as the launcher restarts it."""

import asyncio
import random
import time

import pytest
import torch
from safetensors.torch import load_file

from rlfleet.common.testing import unique_run_id
from rlfleet.trainer.checkpointer import Checkpointer
from rlfleet.trainer.testing import (
    TrainerProcess,
    publish_trajectories_to,
    trajectory_protos,
    write_tiny_model,
)
from rlfleet.weights import DirectoryWeightStore

pytestmark = [pytest.mark.integration, pytest.mark.slow]

G, GROUPS, PER_STEP = 4, 12, 2
STEPS = GROUPS // PER_STEP


@pytest.mark.parametrize("backend", ["torch", "torch-ppo", "torch-lora", "torch-standby",
                                     pytest.param("megatron", marks=pytest.mark.timeout(900))])
def test_trainer_killed_mid_run_resumes_and_trains_every_trajectory_exactly_once(tmp_path, nats_url, backend):
    backend, _, variant = backend.partition("-")
    lora, standby = variant == "lora", variant == "standby"
    loss = "" if lora or standby else variant
    seed = time.time_ns() % 10**6
    rng = random.Random(seed)
    run = unique_run_id("tk")
    # Longer sequences and a wider model than the other tests: steps long enough to be killed inside.
    model = write_tiny_model(tmp_path / "model", hidden_size=128)
    published = trajectory_protos(GROUPS, G, run, lengths=(96, 160), seed=seed)
    asyncio.run(publish_trajectories_to(nats_url, run, published))

    args = ("--group-size", str(G), "--groups-per-step", str(PER_STEP), "--max-staleness", "1000",
            "--consumer.ack-wait-s", "2", "--checkpoint.every", "1", "--optim.lr", "1e-3",
            "--backend.name", backend, "--loss.algorithm", loss or "grpo",
            *(("--lora.enabled", "true") if lora else ()))
    kills = []
    spare = None
    for attempt in range(3):
        trainer = spare.promote() if spare is not None else \
            TrainerProcess(tmp_path, nats_url, run, model, *args).start(timeout_s=300)
        spare = None
        try:
            restored_step = trainer.wait_for(lambda s: s.state != "starting", what="a restore").step
            if attempt < 2:
                # Killed at a random moment once this process has made progress of its own: inside a
                # step, a checkpoint, a weight-store write or an announcement, or between them.
                # The first kill waits for a checkpoint too, so that there is one to resume from: on a
                # loaded machine two kills inside the first step's checkpoint left nothing to restore.
                trainer.wait_for(lambda s, after=restored_step, first=attempt == 0:
                                 (s.step > after and (not first or s.last_checkpoint))
                                 or s.trained_trajectories == G * GROUPS, what="a step")
                if standby:
                    spare = trainer.standby()
                time.sleep(rng.uniform(0.0, 0.3))
                trainer.kill()
                kills.append(trainer.log().count("-> version"))
                continue
            status = trainer.wait_for(lambda s: s.trained_trajectories == G * GROUPS and s.queue_depth == 0,
                                      timeout_s=60, what="every trajectory trained and acked")
        except BaseException:
            if spare is not None:
                spare.stop()
            raise
        finally:
            trainer.stop()

    context = f"seed {seed}, killed after {kills} steps logged"
    assert "restored checkpoint" in trainer.log(), context
    restored = Checkpointer(tmp_path / "checkpoints" / run).latest()
    trained = [tid for record in restored.ledger.records() for tid in record.ids]
    assert len(trained) == len(set(trained)), f"a trajectory was trained twice ({context})"
    assert set(trained) == {t.trajectory_id for t in published}, f"trajectories lost ({context})"
    assert [r.step for r in restored.ledger.records()] == list(range(1, STEPS + 1)), context
    assert (restored.state.step == STEPS and status.step == STEPS
            and status.trained_trajectories == len(published))
    if loss == "ppo":
        critic = torch.load(restored.path / "value_model" / "trainer_state.pt", weights_only=False)
        assert critic["step"] == STEPS, context
    if lora:
        saved = load_file(restored.path / "model.safetensors")
        assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved), context
        store = DirectoryWeightStore(tmp_path / "weights", run)
        kinds = {v: store.index(v).kind for v in store.list_versions()}
        assert kinds[0] == "full" and all(kinds[v] == "adapter" for v in kinds if v), (kinds, context)
        assert all(store.index(v).base_version == 0 for v in kinds if v), context
