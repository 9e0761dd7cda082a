import json

from rlfleet.cli.gate import GateConfig, decide
from rlfleet.cli.report import EvalResult, GateDecision, RunRecord, StepRecord, TrajectoryRecord, write_report


def result(success, invalid=0.0, safety=0.0, time_s=1.0, label="candidate", split="heldout", version=1):
    return EvalResult(version=version, split=split, episodes=100, success=success, invalid_tool_calls=invalid,
                      safety_violations=safety, time_to_completion_s=time_s, interactions=2.0, elapsed_s=1.0,
                      label=label)


def test_gate_accepts_a_candidate_that_is_better_and_no_worse_elsewhere():
    decision = decide(GateConfig(), result(0.6), result(0.5))
    assert decision.accepted and "0.500 -> 0.600" in decision.reasons[0]


def test_gate_refuses_a_candidate_that_is_not_better_on_held_out():
    decision = decide(GateConfig(), result(0.5), result(0.5))
    assert not decision.accepted and "not above" in decision.reasons[0]


def test_gate_refuses_a_better_candidate_whose_invalid_tool_calls_or_safety_violations_rise():
    assert not decide(GateConfig(), result(0.7, invalid=0.2), result(0.5, invalid=0.0)).accepted
    assert not decide(GateConfig(), result(0.7, safety=0.01), result(0.5)).accepted


def test_gate_refuses_a_candidate_that_got_much_slower_or_regressed():
    assert not decide(GateConfig(), result(0.7, time_s=2.5), result(0.5, time_s=1.0)).accepted
    decision = decide(GateConfig(), result(0.7), result(0.5), result(0.3, split="regression"),
                      result(0.6, split="regression"))
    assert not decision.accepted and any("regression" in r for r in decision.reasons)


def test_report_writes_summary_plots_and_html(tmp_path):
    record = RunRecord("r", "async", {}, 0.0, wall_s=60.0)
    record.evals = [result(0.3, label="baseline", version=0), result(0.6, label="final", version=8)]
    record.steps = [StepRecord(step=i, version=i, elapsed_s=i * 5.0, reward_mean=0.3 + i / 40) for i in range(1, 9)]
    record.gate = [GateDecision(4, True, ["held-out success 0.300 -> 0.500 (+0.200)"], 20.0)]
    record.trajectories = [TrajectoryRecord(1.0 * i, 60, 20, float(i % 2), bool(i % 2), "completed", "train", i // 4,
                                            i % 3, 0.05, [0.1, 0.2]) for i in range(40)]
    record.weight_pauses_s = [0.001, 0.002]
    record.cpu = [(2.0, 80.0), (4.0, 90.0)]
    summary = write_report(record, tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text())["heldout_success_gain"] == summary["heldout_success_gain"]
    assert abs(summary["heldout_success_gain"] - 0.3) < 1e-9
    assert summary["staleness"]["max"] == 2
    assert summary["trajectories"]["train"] == 40
    page = (tmp_path / "report.html").read_text()
    assert "Baseline vs RL" in page and "report/reward_success.png" in page
    for png in ("reward_success.png", "rollout.png", "versions.png", "cpu.png"):
        assert (tmp_path / "report" / png).stat().st_size > 1000
