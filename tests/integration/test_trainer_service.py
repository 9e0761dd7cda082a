"""The trainer as a process: consuming real JetStream messages, stepping, publishing versions."""

import asyncio
import urllib.request

import grpc
import pytest
import torch
from safetensors.torch import load_file

from rlfleet.api.common.v1 import common_pb2
from rlfleet.common.config import NatsConfig
from rlfleet.common.grpc_server import check_health
from rlfleet.common.streams import connect_nats, durable_name, ensure_consumer, ensure_streams, publish
from rlfleet.common.testing import unique_run_id
from rlfleet.trainer.checkpointer import Checkpointer
from rlfleet.trainer.testing import TrainerProcess, publish_trajectories, trajectory_protos, write_tiny_model
from rlfleet.weights import DirectoryWeightStore

pytestmark = pytest.mark.integration

G = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture
async def js(nats_url):
    nc = await connect_nats(NatsConfig(url=nats_url), "test-trainer")
    js = nc.jetstream()
    await ensure_streams(js)
    yield js
    await nc.close()


@pytest.fixture
def trainers():
    started: list[TrainerProcess] = []

    def start(*args, **kwargs) -> TrainerProcess:
        started.append(TrainerProcess(*args, **kwargs))
        return started[-1].start()

    yield start
    for t in started:
        t.stop()


async def announcements(js, run_id: str, n: int) -> list:
    """The first n PolicyVersion messages of the run, with their Nats-Msg-Id."""
    durable = durable_name("test", run_id)
    await ensure_consumer(js, "POLICY", durable, run_id)
    sub = await js.pull_subscribe_bind(durable, "POLICY")
    out = []
    while len(out) < n:
        for msg in await sub.fetch(n - len(out), timeout=10):
            pv = common_pb2.PolicyVersion()
            pv.ParseFromString(msg.data)
            out.append((msg.headers["Nats-Msg-Id"], pv))
            await msg.ack()
    return out


def trainer_args(*extra: str) -> list[str]:
    return ["--group-size", str(G), "--groups-per-step", "2", "--optim.lr", "1e-3", *extra]


async def test_trainer_steps_on_published_groups_and_announces_versions_transformers_loads(
        tmp_path, nats_url, js, model_dir, trainers):
    import transformers

    run = unique_run_id("tr")
    await publish_trajectories(js, run, trajectory_protos(2, G, run))
    trainer = trainers(tmp_path, nats_url, run, model_dir, *trainer_args("--weights.full-every", "1"))
    status = trainer.wait_for(lambda s: s.step == 1 and s.queue_depth == 0 and s.state == "waiting_for_data",
                              what="one step, acked and published")

    (id0, v0), (id1, v1) = await announcements(js, run, 2)
    assert (id0, v0.version, v0.parent_version, v0.step) == (f"{run}-v0", 0, -1, 0)
    assert (id1, v1.version, v1.parent_version, v1.step) == (f"{run}-v1", 1, 0, 1)
    assert v1.format == common_pb2.WEIGHT_FORMAT_FULL and v1.served_dtype == "bf16" and v1.run_id == run
    assert v1.checksum.startswith("sha256:") and v1.num_bytes > 0 and v1.uri == v1.full_uri
    assert {"loss", "grad_norm", "entropy", "clip_frac", "reward_mean", "logprob_gap_mean"} <= set(v1.metrics)

    store = DirectoryWeightStore(tmp_path / "weights", run)
    assert v1.uri == store.uri(1) and (store.path(1) / "tokenizer.json").is_file()
    served = transformers.AutoModelForCausalLM.from_pretrained(store.path(1),
                                                               dtype=torch.bfloat16).state_dict()
    checkpoint = load_file(Checkpointer(tmp_path / "checkpoints" / run).latest().path / "model.safetensors")
    trainers_own = {k.removeprefix("lm."): v.to(torch.bfloat16) for k, v in checkpoint.items()}
    assert set(served) == set(trainers_own)
    assert all(torch.equal(served[k], trainers_own[k]) for k in served)
    starting = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).state_dict()
    assert any(not torch.equal(starting[k], served[k]) for k in served)

    assert status.policy_version == 1 and status.trained_trajectories == 2 * G and status.loss == "grpo"
    assert status.state == "waiting_for_data" and status.last_checkpoint.endswith("v00000001")
    assert {"loss", "grad_norm", "staleness_max", "tokens_per_s"} <= set(status.last_metrics)
    assert 0.0 < status.idle_fraction <= 1.0
    reply = trainer.call("Checkpoint")
    assert (reply.step, reply.policy_version, reply.path) == (1, 1, status.last_checkpoint)
    url = f"http://127.0.0.1:{trainer.info['metrics_port']}/metrics"
    metrics = (await asyncio.to_thread(lambda: urllib.request.urlopen(url).read())).decode()
    for name in ("rlfleet_trainer_steps_total", "rlfleet_trainer_loss_value", "rlfleet_trainer_idle_ratio",
                 "rlfleet_trainer_staleness_versions_bucket", "rlfleet_trainer_trained_tokens_total"):
        assert name in metrics, name
    # A group short of one sample waits in memory: in the queue depth, and said to be waiting for its group.
    await publish_trajectories(js, run, trajectory_protos(1, G, run, prefix="late-")[:G - 1])
    status = trainer.wait_for(lambda s: s.pending_groups == 1 and s.pending_samples == G - 1,
                              what="an incomplete group held")
    assert status.queue_depth == G - 1 and status.step == 1
    assert trainer.stop() == 0


async def test_malformed_mismatched_and_out_of_vocab_messages_are_counted_and_skipped(
        tmp_path, nats_url, js, model_dir, trainers):
    run = unique_run_id("tb")
    bad_lengths, out_of_vocab, failed = trajectory_protos(1, 3, run, prefix="bad-")
    bad_lengths.rollout_logprobs.append(-1.0)
    out_of_vocab.token_ids[5] = 10_000
    failed.status = common_pb2.TRAJECTORY_STATUS_FAILED
    await publish(js, "TRAJECTORIES", run, b"\x0a\xff\xff not a trajectory", msg_type="Trajectory",
                  msg_id="junk")
    await publish_trajectories(js, run, [bad_lengths, out_of_vocab, failed, *trajectory_protos(2, G, run)])
    trainer = trainers(tmp_path, nats_url, run, model_dir, *trainer_args())
    status = trainer.wait_for(lambda s: s.step == 1 and s.queue_depth == 0,
                              what="a step past the bad messages")
    assert dict(status.dropped_by_reason) == {"malformed": 1, "length_mismatch": 1,
                                              "out_of_vocab": 1, "failed": 1}
    assert status.trained_trajectories == 2 * G
    await publish_trajectories(js, run, trajectory_protos(2, G, run, seed=1, prefix="more-"))
    trainer.wait_for(lambda s: s.step == 2 and s.queue_depth == 0, what="a second step")


async def test_pause_stops_consuming_after_the_step_and_resume_continues(
        tmp_path, nats_url, js, model_dir, trainers):
    run = unique_run_id("tp")
    trainer = trainers(tmp_path, nats_url, run, model_dir, *trainer_args())
    trainer.wait_for(lambda s: s.state == "waiting_for_data", what="a started trainer")
    trainer.call("Pause")
    await publish_trajectories(js, run, trajectory_protos(2, G, run))
    status = trainer.wait_for(lambda s: s.queue_depth == 2 * G, what="the queue to fill")
    assert status.paused and status.state == "paused" and status.step == 0
    trainer.call("Resume")
    status = trainer.wait_for(lambda s: s.step == 1 and s.queue_depth == 0, what="a step after resume")
    assert not status.paused


async def test_two_fresh_trainers_on_the_same_stream_publish_bit_identical_weights(
        tmp_path, nats_url, js, model_dir, trainers):
    run = unique_run_id("td")
    await publish_trajectories(js, run, trajectory_protos(4, G, run, seed=5))
    a, b = (trainers(tmp_path / name, nats_url, run, model_dir,
                     *trainer_args("--consumer.name", f"trainer-{name}"))
            for name in ("a", "b"))
    for t in (a, b):
        t.wait_for(lambda s: s.step == 2 and s.state == "waiting_for_data", what="two steps, published")
    stores = [DirectoryWeightStore(tmp_path / name / "weights", run) for name in ("a", "b")]
    for version in (1, 2):
        wa, wb = (s.load_version(version) for s in stores)
        assert all((wa[k] == wb[k]).all() for k in wa), version
    fp32 = [load_file(Checkpointer(tmp_path / n / "checkpoints" / run).latest().path / "model.safetensors")
            for n in ("a", "b")]
    assert all(torch.equal(fp32[0][k], fp32[1][k]) for k in fp32[0])


async def test_trainer_without_a_model_serves_health_and_says_it_is_idle(tmp_path, nats_url, trainers):
    trainer = trainers(tmp_path, nats_url, unique_run_id("tn"), None)
    assert await check_health(trainer.address, "rlfleet.trainer.v1.TrainerService")
    status = trainer.status()
    assert status.state == "no_model" and "model_path" in status.state_message and status.policy_version == -1
    with pytest.raises(grpc.RpcError) as info:
        trainer.call("Checkpoint")
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert trainer.stop() == 0


@pytest.mark.slow
async def test_trainer_under_torchrun_trains_on_two_ranks_and_stops_cleanly(tmp_path, nats_url, js, model_dir,
                                                                              trainers):
    run = unique_run_id("tt")
    await publish_trajectories(js, run, trajectory_protos(2, G, run))
    trainer = trainers(tmp_path, nats_url, run, model_dir, *trainer_args(), nproc=2)
    status = trainer.wait_for(lambda s: s.step == 1 and s.state == "waiting_for_data", timeout_s=120,
                              what="a step on two ranks")
    assert status.trained_trajectories == 2 * G and status.queue_depth == 0
    checkpoint = Checkpointer(tmp_path / "checkpoints" / run).latest().path
    assert {p.name for p in (checkpoint / "rng").iterdir()} == {"rank0.pt", "rank1.pt"}
    assert DirectoryWeightStore(tmp_path / "weights", run).latest_version() == 1
    trainer.stop()  # torchrun forwards SIGTERM; rank 0 checkpoints if needed, then releases rank 1
    log = trainer.log()
    assert "rlfleet.common.service: stopped" in log and "rank 1: closed by rank 0" in log, log[-3000:]
    assert " ERROR " not in log and " CRITICAL " not in log, log[-3000:]
