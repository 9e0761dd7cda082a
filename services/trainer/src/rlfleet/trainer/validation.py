"""From a TRAJECTORIES message to a trainable sample, or a rejection with its reason.

Everything the trainer could misread is checked once, here, so that a bad message is counted and
dropped instead of poisoning a batch or killing the loop: the schema version, the run, array
lengths, the loss mask (0/1, 0 on the first token, 1 only inside generated spans), token IDs
inside the model's vocabulary, finite log-probs and reward, and the status (COMPLETED and
TRUNCATED are trained; ABORTED and FAILED are dropped).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from google.protobuf.message import DecodeError

from rlfleet.api.common.v1 import common_pb2
from rlfleet.trainer.batching import TrainSample

SCHEMA_VERSION = common_pb2.SCHEMA_VERSION_1
TRAINED_STATUSES = {common_pb2.TRAJECTORY_STATUS_COMPLETED, common_pb2.TRAJECTORY_STATUS_TRUNCATED}
DROPPED_STATUSES = {common_pb2.TRAJECTORY_STATUS_ABORTED: "aborted",
                    common_pb2.TRAJECTORY_STATUS_FAILED: "failed"}


class Rejected(Exception):
    """A trajectory the trainer will not train on; `reason` is the dropped_by_reason key.

    `invalid` is True for messages that are wrong (terminated on the stream), False for valid
    messages the trainer chooses not to train on (acked).
    """

    def __init__(self, reason: str, detail: str, *, invalid: bool = True, trajectory_id: str = "",
                 group_id: str = "") -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.invalid = invalid
        self.trajectory_id = trajectory_id
        self.group_id = group_id


@dataclass(frozen=True)
class Limits:
    run_id: str
    vocab_size: int
    max_tokens: int
    # Evaluation episodes (held-out, regression) are published to the audit log too; never trained on.
    trained_splits: tuple[str, ...] = ("train", "")


@dataclass
class Candidate:
    """A validated trajectory waiting for its group."""

    sample: TrainSample
    group_size: int  # 0 when the trajectory does not say
    sample_index: int
    oldest_version: int | None  # policy version of the oldest generated span; None without one
    trace_context: dict[str, str] = field(default_factory=dict)  # the episode's trace, for the step's link

    @property
    def trajectory_id(self) -> str:
        return self.sample.trajectory_id

    @property
    def group_id(self) -> str:
        return self.sample.group_id

    @property
    def num_tokens(self) -> int:
        return len(self.sample.token_ids)


def decode(payload: bytes) -> common_pb2.Trajectory:
    traj = common_pb2.Trajectory()
    try:
        traj.ParseFromString(payload)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise Rejected("malformed", f"not a Trajectory protobuf ({exc})") from None
    if not traj.trajectory_id:
        raise Rejected("malformed", "trajectory_id is empty")
    return traj


def validate(traj: common_pb2.Trajectory, limits: Limits) -> Candidate:
    """The trajectory as a `Candidate`, or `Rejected` with the first reason found."""
    tid, gid = traj.trajectory_id, traj.group_id

    def reject(reason: str, detail: str, invalid: bool = True) -> Rejected:
        return Rejected(reason, f"trajectory {tid}: {detail}", invalid=invalid,
                        trajectory_id=tid, group_id=gid)

    if traj.schema_version != SCHEMA_VERSION:
        raise reject("unknown_schema",
                     f"schema_version {traj.schema_version}, this trainer reads {SCHEMA_VERSION}")
    if traj.run_id and traj.run_id != limits.run_id:
        raise reject("wrong_run", f"run_id {traj.run_id!r} on run {limits.run_id!r}'s subject")
    if not gid:
        raise reject("malformed", "group_id is empty")
    if traj.status in DROPPED_STATUSES:
        raise reject(DROPPED_STATUSES[traj.status], "status says so", invalid=False)
    if traj.status not in TRAINED_STATUSES:
        raise reject("unknown_status", f"status {traj.status}")
    if traj.split not in limits.trained_splits:
        raise reject("not_train_split", f"split {traj.split!r} is for evaluation", invalid=False)
    tokens = np.asarray(traj.token_ids, dtype=np.int64)
    logprobs = np.asarray(traj.rollout_logprobs, dtype=np.float64)
    mask = np.asarray(traj.loss_mask, dtype=np.int64)
    n = tokens.size
    if n == 0:
        raise reject("empty", "no tokens")
    if logprobs.size != n or mask.size != n:
        raise reject("length_mismatch", f"token_ids ({n}), rollout_logprobs ({logprobs.size}) and "
                     f"loss_mask ({mask.size}) differ in length")
    if n > limits.max_tokens:
        raise reject("too_long", f"{n} tokens, the model takes {limits.max_tokens}")
    if ((mask != 0) & (mask != 1)).any() or mask[0] != 0:
        raise reject("bad_loss_mask", "loss_mask must be 0/1 and 0 on the first token")
    if tokens.min() < 0 or tokens.max() >= limits.vocab_size:
        raise reject("out_of_vocab", f"token IDs span [{tokens.min()}, {tokens.max()}], vocabulary is "
                     f"{limits.vocab_size}")
    if not np.isfinite(logprobs[mask == 1]).all():
        raise reject("bad_logprobs", "non-finite rollout log-prob on a loss token")
    oldest = _oldest_generated_version(traj, mask, reject)
    if not traj.HasField("verdict"):
        raise reject("no_verdict", "no verdict, so no reward")
    reward = float(traj.verdict.reward)
    if not np.isfinite(reward):
        raise reject("bad_reward", f"reward {reward}")
    sample = TrainSample(trajectory_id=tid, group_id=gid, token_ids=tokens.tolist(),
                         rollout_logprobs=np.where(mask == 1, logprobs, 0.0).tolist(),
                         loss_mask=mask.tolist(), reward=reward,
                         policy_version=oldest if oldest is not None else 0)
    return Candidate(sample=sample, group_size=traj.group_size, sample_index=traj.sample_index,
                     oldest_version=oldest, trace_context=dict(traj.trace_context))


def _oldest_generated_version(traj: common_pb2.Trajectory, mask: np.ndarray, reject) -> int | None:
    """Checks the spans (inside the sequence, loss tokens only in generated spans) and returns the
    policy version of the oldest generated span."""
    n = mask.size
    generated = np.zeros(n, dtype=bool)
    versions = []
    for span in traj.spans:
        if not 0 <= span.start < span.end <= n:
            raise reject("bad_spans", f"span [{span.start}, {span.end}) outside [0, {n})")
        if span.kind == common_pb2.SPAN_KIND_GENERATED:
            generated[span.start:span.end] = True
            versions.append(span.policy_version)
    if (mask.astype(bool) & ~generated).any():
        raise reject("bad_spans", "loss_mask is 1 outside every generated span")
    if any(v < 0 for v in versions):
        raise reject("bad_spans", "a generated span has no policy_version")
    return min(versions) if versions else None
