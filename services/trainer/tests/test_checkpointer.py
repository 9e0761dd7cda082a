import pytest

from rlfleet.trainer.checkpointer import STATE_FILE, Checkpointer, ServiceState
from rlfleet.trainer.ledger import StepRecord, TrainedLedger
from rlfleet.trainer.service_config import TrainerConfig


def state(step: int) -> ServiceState:
    return ServiceState(run_id="r", step=step, policy_version=step, parent_version=step - 1,
                        trained_trajectories=2 * step, dropped_by_reason={"stale": 1})


def backend_files(path):
    (path / "model.safetensors").write_bytes(b"weights")


def test_the_ledger_refuses_to_train_a_trajectory_twice():
    ledger = TrainedLedger([StepRecord(1, 1, ("a", "b"))])
    ledger.record(2, 2, ["c"])
    with pytest.raises(ValueError, match="second time"):
        ledger.record(3, 3, ["a"])
    with pytest.raises(ValueError, match="second time"):
        ledger.record(3, 3, ["c"])


def test_uncommitted_steps_become_durable_only_on_commit():
    ledger = TrainedLedger()
    ledger.record(1, 1, ["a", "b"])
    assert "a" in ledger and not ledger.is_durable("a") and ledger.trained_count == 2
    assert ledger.commit() == ["a", "b"]
    assert ledger.is_durable("a") and ledger.uncommitted == [] and ledger.commit() == []


def test_a_checkpoint_round_trips_its_state_and_ledger(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=2)
    records = [StepRecord(1, 1, ("a", "b")), StepRecord(2, 2, ("c",))]
    path = ckpt.save(state(2), records, backend_files)
    restored = ckpt.latest()
    assert restored.path == path and (path / "model.safetensors").read_bytes() == b"weights"
    assert restored.state.step == 2 and restored.state.dropped_by_reason == {"stale": 1}
    assert restored.ledger.records() == records and restored.ledger.is_durable("c")


def test_a_half_written_checkpoint_is_never_restored_and_is_cleaned_up(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(state(1), [], backend_files)
    crashed = tmp_path / ".tmp-v00000002-123"
    crashed.mkdir()
    (crashed / STATE_FILE).write_text("{}")
    (tmp_path / "v00000003").mkdir()  # renamed by hand, without its state file
    assert ckpt.latest().state.step == 1
    ckpt.remove_temporaries()
    assert not crashed.exists()


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in (1, 2, 3):
        ckpt.save(state(step), [], backend_files)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000002", "v00000003"]


def test_saving_a_version_that_has_a_checkpoint_returns_it_unchanged(tmp_path):
    ckpt = Checkpointer(tmp_path)
    first = ckpt.save(state(1), [], backend_files)
    assert ckpt.save(state(1), [], lambda p: pytest.fail("rewrote the checkpoint")) == first


def test_the_consumer_must_be_allowed_to_hold_everything_not_yet_checkpointed():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="max_ack_pending"):
        TrainerConfig(group_size=8, groups_per_step=4, checkpoint={"every": 4},
                      consumer={"max_ack_pending": 100})
    cfg = TrainerConfig(weight_store="/data/weights", run_id="r1")
    assert cfg.consumer_name() == "trainer-r1" and str(cfg.checkpoint_dir()) == "/data/checkpoints/r1"
