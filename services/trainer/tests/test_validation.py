import math

import pytest

from rlfleet.api.common.v1 import common_pb2
from rlfleet.trainer.testing import trajectory_protos
from rlfleet.trainer.validation import Limits, Rejected, decode, validate

LIMITS = Limits(run_id="r", vocab_size=320, max_tokens=64)


def trajectory(**changes) -> common_pb2.Trajectory:
    traj = trajectory_protos(1, 2, "r", seed=3)[1]
    for key, value in changes.items():
        if isinstance(value, list):
            traj.ClearField(key)
            getattr(traj, key).extend(value)
        else:
            setattr(traj, key, value)
    return traj


def rejection(traj: common_pb2.Trajectory) -> Rejected:
    with pytest.raises(Rejected) as info:
        validate(traj, LIMITS)
    return info.value


def test_a_valid_trajectory_becomes_a_sample_with_its_reward_and_oldest_generated_version():
    traj = trajectory()
    traj.spans[1].policy_version = 7
    traj.spans[3].policy_version = 5
    c = validate(traj, LIMITS)
    assert c.sample.token_ids == list(traj.token_ids) and c.sample.loss_mask == list(traj.loss_mask)
    assert c.sample.reward == 1.0 and c.group_size == 2 and c.sample_index == 1
    assert c.oldest_version == 5 and c.sample.policy_version == 5


def test_undecodable_bytes_are_rejected_as_malformed():
    with pytest.raises(Rejected) as info:
        decode(b"\xff\xff\xff not a protobuf")
    assert info.value.reason == "malformed" and info.value.invalid


def test_arrays_of_different_lengths_are_rejected():
    traj = trajectory()
    traj.rollout_logprobs.append(-1.0)
    assert rejection(traj).reason == "length_mismatch"


def test_token_ids_outside_the_vocabulary_are_rejected():
    traj = trajectory()
    traj.token_ids[3] = 320
    assert rejection(traj).reason == "out_of_vocab"
    traj.token_ids[3] = -1
    assert rejection(traj).reason == "out_of_vocab"


@pytest.mark.parametrize("position, value", [(0, 1), (4, 2)])
def test_a_loss_mask_that_is_not_0_1_or_is_set_on_the_first_token_is_rejected(position, value):
    traj = trajectory()
    traj.loss_mask[position] = value
    assert rejection(traj).reason == "bad_loss_mask"


@pytest.mark.parametrize("status, reason", [(common_pb2.TRAJECTORY_STATUS_ABORTED, "aborted"),
                                            (common_pb2.TRAJECTORY_STATUS_FAILED, "failed")])
def test_aborted_and_failed_trajectories_are_dropped_but_are_not_invalid(status, reason):
    r = rejection(trajectory(status=status))
    assert r.reason == reason and not r.invalid and r.group_id == "r-g0"


def test_truncated_trajectories_are_trained():
    assert validate(trajectory(status=common_pb2.TRAJECTORY_STATUS_TRUNCATED), LIMITS).sample.reward == 1.0


@pytest.mark.parametrize("changes, reason", [
    ({"schema_version": 2}, "unknown_schema"),
    ({"run_id": "other"}, "wrong_run"),
    ({"group_id": ""}, "malformed"),
    ({"status": common_pb2.TRAJECTORY_STATUS_UNSPECIFIED}, "unknown_status"),
    ({"token_ids": [], "rollout_logprobs": [], "loss_mask": []}, "empty"),
])
def test_records_the_trainer_cannot_read_are_rejected_with_their_reason(changes, reason):
    assert rejection(trajectory(**changes)).reason == reason


def test_a_trajectory_longer_than_the_model_takes_is_rejected():
    traj = trajectory()
    n = 65
    traj.ClearField("spans")
    for key, value in (("token_ids", [5] * n), ("rollout_logprobs", [0.0] * n), ("loss_mask", [0] * n)):
        traj.ClearField(key)
        getattr(traj, key).extend(value)
    assert rejection(traj).reason == "too_long"


def test_a_loss_token_outside_every_generated_span_is_rejected():
    traj = trajectory()
    traj.spans[1].kind = common_pb2.SPAN_KIND_OBSERVATION
    assert rejection(traj).reason == "bad_spans"


def test_a_non_finite_rollout_logprob_or_reward_is_rejected():
    traj = trajectory()
    traj.rollout_logprobs[3] = math.nan
    assert rejection(traj).reason == "bad_logprobs"
    traj = trajectory()
    traj.verdict.reward = math.inf
    assert rejection(traj).reason == "bad_reward"


def test_a_trajectory_without_a_verdict_is_rejected():
    traj = trajectory()
    traj.ClearField("verdict")
    assert rejection(traj).reason == "no_verdict"



def test_evaluation_split_trajectories_are_dropped_not_trained():
    r = rejection(trajectory(split="heldout"))
    assert r.reason == "not_train_split" and not r.invalid
