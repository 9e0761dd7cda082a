"""The trainer service with `backend.name = "megatron"`: real JetStream messages, real steps, versions
in the weight store that are the torch backend's versions (up to fp32 kernel differences)."""

import asyncio
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from rlfleet.common.config import load_config
from rlfleet.common.testing import unique_run_id
from rlfleet.trainer.checkpointer import Checkpointer
from rlfleet.trainer.service_config import TrainerConfig
from rlfleet.trainer.testing import (
    TrainerProcess,
    publish_trajectories_to,
    trajectory_protos,
    write_tiny_model,
)
from rlfleet.weights import DirectoryWeightStore

# Megatron trainers start slower than torch ones (megatron-core's import, the conversion): generous on a busy
# machine.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

G = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture
def trainers():
    started: list[TrainerProcess] = []

    def start(*args, **kwargs) -> TrainerProcess:
        started.append(TrainerProcess(*args, **kwargs))
        return started[-1].start(timeout_s=180)

    yield start
    for t in started:
        t.stop()


def args(name: str, *extra: str) -> list[str]:
    return ["--group-size", str(G), "--groups-per-step", "2", "--optim.lr", "1e-3",
            "--weights.served-dtype", "fp32", "--weights.full-every", "1",
            "--consumer.name", f"trainer-{name}", *extra]


MEGATRON_TP2 = ("--backend.name", "megatron", "--megatron.tensor-parallel", "2")


def test_megatron_trainer_at_tp_2_publishes_the_versions_the_torch_trainer_publishes(
        tmp_path, nats_url, model_dir, trainers):
    run = unique_run_id("tm")
    asyncio.run(publish_trajectories_to(nats_url, run, trajectory_protos(6, G, run, seed=3)))
    megatron = trainers(tmp_path / "megatron", nats_url, run, model_dir,
                        *args("megatron", *MEGATRON_TP2), nproc=2)
    torch_trainer = trainers(tmp_path / "torch", nats_url, run, model_dir, *args("torch"))
    done = lambda s: s.step == 3 and s.state == "waiting_for_data" and s.queue_depth == 0  # noqa: E731
    status = megatron.wait_for(done, timeout_s=240, what="three Megatron steps, published")
    torch_trainer.wait_for(done, timeout_s=240, what="three torch steps, published")
    assert status.trained_trajectories == 6 * G and status.loss == "grpo"
    assert {"loss", "grad_norm", "entropy", "logprob_gap_mean", "clip_frac"} <= set(status.last_metrics)

    checkpoint = Checkpointer(tmp_path / "megatron" / "checkpoints" / run).latest().path
    assert {p.name for p in (checkpoint / "megatron").iterdir()} >= {"tp0.pt", "tp1.pt"}
    stores = [DirectoryWeightStore(tmp_path / name / "weights", run) for name in ("megatron", "torch")]
    starting = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    for version in (1, 2, 3):
        ours, theirs = (s.load_version(version) for s in stores)
        assert set(ours) == set(theirs)
        assert max(float(np.abs(ours[k] - theirs[k]).max()) for k in ours) <= 5e-5, version
    served = transformers.AutoModelForCausalLM.from_pretrained(stores[0].path(3), dtype=torch.float32)
    served = served.state_dict()
    assert max(float((served[k] - starting[k]).abs().max()) for k in served) > 1e-3  # it trained
    megatron.stop()
    log = megatron.log()
    assert "rank 1: closed by rank 0" in log and " ERROR " not in log and " CRITICAL " not in log, log[-3000:]


def test_megatron_trainer_refuses_a_checkpoint_of_another_tensor_parallel_size(tmp_path, nats_url, model_dir,
                                                                              trainers):
    run = unique_run_id("tq")
    asyncio.run(publish_trajectories_to(nats_url, run, trajectory_protos(2, G, run, seed=4)))
    first = trainers(tmp_path, nats_url, run, model_dir, *args("a", "--backend.name", "megatron"))
    first.wait_for(lambda s: s.step == 1 and s.queue_depth == 0, timeout_s=120, what="a step")
    assert first.stop() == 0
    second = TrainerProcess(tmp_path, nats_url, run, model_dir, *args("a", *MEGATRON_TP2), nproc=2)
    second.start(timeout_s=180)
    try:
        second.process.wait(timeout=180)
    finally:
        second.stop()
    assert second.process.returncode != 0
    assert "saved at tensor parallel 1; this trainer runs 2" in second.log(), second.log()[-3000:]


def test_calc_megatron_example_is_calc_with_the_trainer_on_megatron():
    root = Path(__file__).resolve().parents[2] / "examples"
    calc = tomllib.loads((root / "calc.toml").read_text())
    megatron = tomllib.loads((root / "calc-megatron.toml").read_text())
    backend = megatron["trainer"].pop("backend")
    assert {**megatron, "run_id": calc["run_id"]} == calc and backend == {"name": "megatron"}
    # The trainer takes the section as it is.
    config = load_config(TrainerConfig, ["--set", "backend.name=megatron"],
                         prog="rlfleet-trainer", environ={})
    assert config.backend.name == "megatron" and config.megatron.tensor_parallel == 1
