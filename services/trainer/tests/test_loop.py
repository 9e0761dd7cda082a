"""The training loop in-process, with a real tiny model and store but an in-memory stream."""

import asyncio
from types import SimpleNamespace

import pytest
import torch
from nats.js.errors import NotFoundError

from rlfleet.api.common.v1 import common_pb2
from rlfleet.trainer.learner import Worker
from rlfleet.trainer.loop import TrainerLoop
from rlfleet.trainer.service_config import TrainerConfig
from rlfleet.trainer.testing import trajectory_protos, write_tiny_model
from rlfleet.weights import DirectoryWeightStore

torch.set_num_threads(1)


class FakeDelivery:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.acked = self.termed = self.naked = False

    async def ack(self) -> None:
        self.acked = True

    async def term(self) -> None:
        self.termed = True

    async def nak(self, delay=None) -> None:
        self.naked = True

    async def in_progress(self) -> None:
        pass


class FakeConsumer:
    def __init__(self) -> None:
        self.queue: list[FakeDelivery] = []

    def put(self, payload: bytes) -> FakeDelivery:
        d = FakeDelivery(payload)
        self.queue.append(d)
        return d

    async def fetch(self) -> list[FakeDelivery]:
        if not self.queue:
            await asyncio.sleep(0.01)
        out, self.queue = self.queue[:8], self.queue[8:]
        return out

    async def queue_depth(self) -> int:
        return len(self.queue)


class FakeJetStream:
    def __init__(self) -> None:
        self.announced: list[tuple[str, common_pb2.PolicyVersion]] = []

    async def publish(self, subject, payload, headers=None, **_):
        msg = common_pb2.PolicyVersion()
        msg.ParseFromString(payload)
        self.announced.append((headers["Nats-Msg-Id"], msg))
        return SimpleNamespace(duplicate=False)

    async def get_last_msg(self, stream, subject):
        if not self.announced:
            raise NotFoundError()
        return SimpleNamespace(data=self.announced[-1][1].SerializeToString())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model"))


def make_loop(tmp_path, model_dir, consumer, js, **overrides) -> TrainerLoop:
    cfg = TrainerConfig(run_id="r", model_path=str(model_dir), weight_store=str(tmp_path / "weights"),
                        group_size=2, groups_per_step=1, torch_threads=1, **overrides)
    store = DirectoryWeightStore(cfg.weight_store, "r")
    return TrainerLoop(cfg, consumer, store, js, Worker())


async def until(predicate, within_s=20.0):
    deadline = asyncio.get_running_loop().time() + within_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_trained_messages_are_acked_only_after_the_checkpoint_that_includes_them(tmp_path, model_dir):
    consumer, js = FakeConsumer(), FakeJetStream()
    loop = make_loop(tmp_path, model_dir, consumer, js, checkpoint={"every": 2})
    deliveries = [consumer.put(t.SerializeToString()) for t in trajectory_protos(3, 2, "r")]
    task = asyncio.create_task(loop.run())
    await until(lambda: loop.learner.step >= 1 and len(js.announced) >= 2)
    assert not any(d.acked for d in deliveries)  # step 1 trained, not in a checkpoint yet
    await until(lambda: loop.learner.step >= 3 and len(js.announced) >= 4)
    assert [d.acked for d in deliveries] == [True] * 4 + [False] * 2  # the step-2 checkpoint has groups 1-2
    await loop.shutdown(task)
    assert all(d.acked for d in deliveries)  # checkpoint on stop
    assert [(mid, m.version, m.parent_version) for mid, m in js.announced] == [
        ("r-v0", 0, -1), ("r-v1", 1, 0), ("r-v2", 2, 1), ("r-v3", 3, 2)]
    restored = loop.checkpointer.latest()
    assert restored.state.step == 3 and restored.ledger.trained_count == 6


async def test_a_restarted_loop_skips_what_its_checkpoint_already_trained(tmp_path, model_dir):
    consumer, js = FakeConsumer(), FakeJetStream()
    protos = trajectory_protos(2, 2, "r")
    first = make_loop(tmp_path, model_dir, consumer, js)
    for t in protos:
        consumer.put(t.SerializeToString())
    task = asyncio.create_task(first.run())
    await until(lambda: first.learner.step >= 2 and len(js.announced) >= 3)
    await first.shutdown(task)

    second = make_loop(tmp_path, model_dir, consumer, js)
    redelivered = [consumer.put(t.SerializeToString()) for t in protos]
    task = asyncio.create_task(second.run())
    await until(lambda: all(d.acked for d in redelivered))
    assert second.learner.step == 2 and second.version == 2
    assert second.intake.dropped_by_reason["duplicate"] == 4
    assert len(js.announced) == 3  # nothing new to announce
    await second.shutdown(task)


async def test_bad_messages_are_terminated_and_counted_without_blocking_the_good_ones(tmp_path, model_dir):
    consumer, js = FakeConsumer(), FakeJetStream()
    loop = make_loop(tmp_path, model_dir, consumer, js)
    good = trajectory_protos(1, 2, "r")
    mismatched = trajectory_protos(1, 2, "r", prefix="bad-")[0]
    mismatched.loss_mask.append(0)
    aborted = trajectory_protos(1, 2, "r", prefix="ab-")[0]
    aborted.status = common_pb2.TRAJECTORY_STATUS_ABORTED
    bad = [consumer.put(b"\x08\x96\x01garbage"), consumer.put(mismatched.SerializeToString()),
           consumer.put(aborted.SerializeToString())]
    fine = [consumer.put(t.SerializeToString()) for t in good]
    task = asyncio.create_task(loop.run())
    await until(lambda: all(d.acked for d in fine))
    assert [d.termed for d in bad] == [True, True, False] and bad[2].acked
    assert dict(loop.intake.dropped_by_reason) == {"malformed": 1, "length_mismatch": 1, "aborted": 1}
    await loop.shutdown(task)


async def test_trajectories_too_many_versions_behind_are_dropped_as_stale(tmp_path, model_dir):
    consumer, js = FakeConsumer(), FakeJetStream()
    loop = make_loop(tmp_path, model_dir, consumer, js, max_staleness=0)
    for t in trajectory_protos(1, 2, "r"):
        consumer.put(t.SerializeToString())
    task = asyncio.create_task(loop.run())
    await until(lambda: loop.version == 1 and len(js.announced) == 2)
    late = [consumer.put(t.SerializeToString()) for t in trajectory_protos(1, 2, "r", prefix="late-")]
    await until(lambda: all(d.acked for d in late))
    assert loop.intake.dropped_by_reason == {"stale": 2} and loop.learner.step == 1
    await loop.shutdown(task)


async def test_a_redelivery_of_a_held_message_is_trained_once_and_its_newest_delivery_acked(
    tmp_path, model_dir
):
    consumer, js = FakeConsumer(), FakeJetStream()
    loop = make_loop(tmp_path, model_dir, consumer, js)
    first, second = (t.SerializeToString() for t in trajectory_protos(1, 2, "r"))
    original, redelivered, other = consumer.put(first), consumer.put(first), consumer.put(second)
    task = asyncio.create_task(loop.run())
    await until(lambda: other.acked)
    assert redelivered.acked and not original.acked  # acking the newest delivery acks the message
    assert loop.learner.step == 1 and loop.ledger.trained_count == 2
    await loop.shutdown(task)


async def test_a_lora_loop_publishes_the_base_then_adapters_and_a_restart_trains_nothing_twice(
    tmp_path, model_dir
):
    consumer, js = FakeConsumer(), FakeJetStream()
    protos = trajectory_protos(3, 2, "r")
    lora = {"enabled": True, "rank": 4}
    first = make_loop(tmp_path, model_dir, consumer, js, lora=lora)
    for t in protos[:4]:
        consumer.put(t.SerializeToString())
    task = asyncio.create_task(first.run())
    await until(lambda: first.learner.step >= 2 and len(js.announced) >= 3)
    await first.shutdown(task)
    formats = [(m.version, m.format, m.base_version) for _, m in js.announced]
    assert formats == [(0, common_pb2.WEIGHT_FORMAT_FULL, -1), (1, common_pb2.WEIGHT_FORMAT_ADAPTER, 0),
                       (2, common_pb2.WEIGHT_FORMAT_ADAPTER, 0)]
    assert js.announced[1][1].num_bytes < js.announced[0][1].num_bytes / 5

    second = make_loop(tmp_path, model_dir, consumer, js, lora=lora)
    redelivered = [consumer.put(t.SerializeToString()) for t in protos]  # groups 1-2 again, then group 3
    task = asyncio.create_task(second.run())
    await until(lambda: all(d.acked for d in redelivered) and len(js.announced) >= 4)
    assert second.learner.step == 3 and second.intake.dropped_by_reason["duplicate"] == 4
    assert (js.announced[-1][1].version, js.announced[-1][1].base_version) == (3, 0)
    tensors, config = second.store.load_adapter(3)
    assert config["r"] == 4 and all(".lora_" in name for name in tensors)
    await second.shutdown(task)
