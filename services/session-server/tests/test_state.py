"""A session's token state: spans tile the tokens, the loss mask marks exactly the generated ones."""

import pytest

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.gateway.v1 import gateway_pb2
from rlfleet.api.session.v1 import session_pb2
from rlfleet.session.state import (
    SessionState,
    append_generated,
    append_observation,
    append_prompt,
    build_trajectory,
)


def new_state(budget: int = 100) -> SessionState:
    session = session_pb2.Session(session_id="s", run_id="r", task_id="t", group_id="g", sample_index=2,
                                  max_total_tokens=budget, metadata={"k": "v"})
    return SessionState(session=session, group_size=4, suite="calc", split="train", opened_ms=1)


def reply(ids, version=3, engine="e0") -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(output_ids=ids,
                                        output_logprobs=[-0.25 * (i + 1) for i in range(len(ids))],
                                        finish_reason=common_pb2.FINISH_REASON_STOP, policy_version=version,
                                        engine_id=engine, latency_s=0.5)


def test_spans_tile_the_tokens_and_the_loss_mask_is_one_exactly_on_generated_tokens():
    state = new_state()
    append_prompt(state, [1, 2, 3])
    assert append_generated(state, reply([7, 8]), finished_at=10.0) == 1
    assert append_observation(state, [4, 5, 6], now=12.5) == (2, 2.5)
    assert append_generated(state, reply([9], version=4, engine="e1"), finished_at=13.0) == 3
    trajectory = build_trajectory(state, "tid", common_pb2.TRAJECTORY_STATUS_UNSPECIFIED, None, {"x": "y"})
    assert list(trajectory.token_ids) == [1, 2, 3, 7, 8, 4, 5, 6, 9]
    assert list(trajectory.loss_mask) == [0, 0, 0, 1, 1, 0, 0, 0, 1]
    assert list(trajectory.rollout_logprobs) == [0, 0, 0, -0.25, -0.5, 0, 0, 0, -0.25]
    assert [(s.kind, s.start, s.end, s.policy_version) for s in trajectory.spans] == [
        (common_pb2.SPAN_KIND_PROMPT, 0, 3, -1), (common_pb2.SPAN_KIND_GENERATED, 3, 5, 3),
        (common_pb2.SPAN_KIND_OBSERVATION, 5, 8, -1), (common_pb2.SPAN_KIND_GENERATED, 8, 9, 4)]
    assert trajectory.spans[2].latency_s == 2.5 and trajectory.spans[3].engine_id == "e1"
    assert trajectory.status == common_pb2.TRAJECTORY_STATUS_COMPLETED
    assert (trajectory.num_turns, trajectory.num_observations, trajectory.group_size) == (2, 1, 4)
    assert (trajectory.timings.generate_s, trajectory.timings.tool_wait_s) == (1.0, 2.5)
    assert dict(trajectory.metadata) == {"k": "v", "x": "y"}
    assert (trajectory.suite, trajectory.split, trajectory.sample_index) == ("calc", "train", 2)


def test_a_turn_that_crossed_a_weight_swap_keeps_both_versions_at_trajectory_offsets():
    state = new_state()
    append_prompt(state, [1, 2, 3])
    swapped = reply([7, 8, 9, 10], version=4)
    swapped.version_ranges.add(policy_version=4, start=0, end=1)
    swapped.version_ranges.add(policy_version=5, start=1, end=4)
    append_generated(state, swapped, finished_at=1.0)
    append_generated(state, reply([11]), finished_at=2.0)  # no ranges from the gateway: one, of its version
    trajectory = build_trajectory(state, "tid", common_pb2.TRAJECTORY_STATUS_UNSPECIFIED, None, {})
    crossed, plain = trajectory.spans[1], trajectory.spans[2]
    assert crossed.policy_version == 4
    assert [(r.policy_version, r.start, r.end) for r in crossed.version_ranges] == [(4, 3, 4), (5, 4, 7)]
    assert [(r.policy_version, r.start, r.end) for r in plain.version_ranges] == [(3, 7, 8)]


def test_tool_wait_counts_only_from_the_last_generate():
    state = new_state()
    append_prompt(state, [1])
    append_generated(state, reply([2]), finished_at=10.0)
    assert append_observation(state, [3], now=11.0)[1] == 1.0
    assert append_observation(state, [4], now=15.0)[1] == 0.0  # waited on nothing new


def test_a_spent_budget_turns_a_completed_close_into_truncated_but_keeps_failed():
    state = new_state(budget=4)
    append_prompt(state, [1, 2])
    append_generated(state, reply([3, 4]), finished_at=1.0)
    assert state.budget_exhausted and state.remaining == 0
    assert build_trajectory(state, "t", common_pb2.TRAJECTORY_STATUS_COMPLETED, None, {}).status == \
        common_pb2.TRAJECTORY_STATUS_TRUNCATED
    assert build_trajectory(state, "t", common_pb2.TRAJECTORY_STATUS_FAILED, None, {}).status == \
        common_pb2.TRAJECTORY_STATUS_FAILED


def test_the_verdict_and_its_verify_time_go_into_the_trajectory():
    state = new_state()
    append_prompt(state, [1])
    verdict = common_pb2.Verdict(session_id="s", reward=1.0, passed=True, verify_s=0.75)
    trajectory = build_trajectory(state, "t", common_pb2.TRAJECTORY_STATUS_COMPLETED, verdict, {})
    assert trajectory.verdict.reward == 1.0 and trajectory.timings.verify_s == 0.75


def test_a_reply_whose_logprobs_do_not_line_up_with_its_tokens_is_refused():
    state = new_state()
    append_prompt(state, [1])
    bad = reply([2, 3])
    del bad.output_logprobs[-1]
    with pytest.raises(ValueError, match="1 log-probs for 2 tokens"):
        append_generated(state, bad, finished_at=1.0)


def test_the_state_round_trips_through_its_storage_form():
    state = new_state()
    append_prompt(state, [1, 2])
    append_generated(state, reply([3]), finished_at=5.0)
    state.sampling.max_new_tokens = 9
    raw = {k.encode(): v for k, v in state.fields().items()} | {b"rev": b"4", b"published": b"1"}
    again = SessionState.from_fields(raw)
    assert again.session == state.session and again.sampling == state.sampling
    assert (again.rev, again.published, again.released, again.last_generate_end) == (4, True, False, 5.0)
