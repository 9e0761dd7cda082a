import json

import numpy as np
import pytest

from rlfleet.cli.gate import (
    GateConfig,
    binomial_tail,
    bootstrap_interval,
    clopper_pearson,
    decide,
    interim,
    merge,
    paired_gain_interval,
    sign_test_p,
    slices,
)
from rlfleet.cli.gate_sim import promotion_rate, task_probabilities
from rlfleet.cli.report import (
    EpisodeRecord,
    EvalResult,
    GateDecision,
    RunRecord,
    StepRecord,
    TaskOutcome,
    TrajectoryRecord,
    episode_figures,
    write_report,
)


def result(success, invalid=0.0, safety=0.0, time_s=1.0, label="candidate", split="heldout", version=1, n=100,
           tasks=None):
    """An evaluation of n tasks whose per-task results have the given means (the first round(success * n)
    tasks passed, the first round(invalid * n) with one invalid call, ...), or the given per-task results."""
    if tasks is None:
        tasks = [TaskOutcome(f"t{i}", i < round(success * n), int(i < round(invalid * n)),
                             int(i < round(safety * n)), time_s) for i in range(n)]
    return EvalResult(version=version, split=split, episodes=len(tasks), success=success,
                      invalid_tool_calls=invalid, safety_violations=safety, time_to_completion_s=time_s,
                      interactions=2.0, elapsed_s=1.0,
                      label=label, tasks=tasks)


def paired(wins, losses, both=40, neither=40, **extra):
    """(candidate, accepted) on wins + losses + both + neither tasks with those discordant counts."""
    pattern = [(1, 0)] * wins + [(0, 1)] * losses + [(1, 1)] * both + [(0, 0)] * neither
    cand = [TaskOutcome(f"t{i}", bool(c), 0, 0, 1.0) for i, (c, _) in enumerate(pattern)]
    acc = [TaskOutcome(f"t{i}", bool(a), 0, 0, 1.0) for i, (_, a) in enumerate(pattern)]
    n = len(pattern)
    return (result(sum(c for c, _ in pattern) / n, tasks=cand, **extra),
            result(sum(a for _, a in pattern) / n, tasks=acc, version=0, label="baseline"))


# -- the statistics, against values computed by hand or from tables ------------------------------


def test_binomial_tail_and_the_sign_test_match_exact_values():
    assert binomial_tail(9, 10, 0.5) == pytest.approx(11 / 1024)        # (C(10,9) + C(10,10)) / 2^10
    assert binomial_tail(0, 10, 0.3) == 1.0 and binomial_tail(11, 10, 0.3) == 0.0
    assert binomial_tail(2, 3, 0.2) == pytest.approx(3 * 0.2**2 * 0.8 + 0.2**3)
    assert sign_test_p(9, 1) == pytest.approx(11 / 1024)
    assert sign_test_p(5, 5) == pytest.approx(638 / 1024)               # P(X >= 5), X ~ Bin(10, 1/2)
    assert sign_test_p(0, 0) == 1.0


def test_clopper_pearson_matches_the_tables():
    # 95% two-sided (each side at 0.025), the usual table values
    assert clopper_pearson(5, 10, 0.025) == pytest.approx((0.18709, 0.81291), abs=1e-5)
    assert clopper_pearson(15, 20, 0.025) == pytest.approx((0.50895, 0.91343), abs=1e-5)
    assert clopper_pearson(1, 10, 0.025) == pytest.approx((0.00253, 0.44502), abs=1e-5)
    # closed forms at the edges: k = 0 -> upper 1 - alpha^(1/n); k = n -> lower alpha^(1/n)
    assert clopper_pearson(0, 10, 0.05) == pytest.approx((0.0, 1 - 0.05 ** 0.1), abs=1e-9)
    assert clopper_pearson(10, 10, 0.05) == pytest.approx((0.05 ** 0.1, 1.0), abs=1e-9)


def test_the_gain_interval_is_the_exact_mcnemar_test_turned_around():
    """Its lower bound is above 0 exactly when the one-sided exact McNemar p-value is at most alpha."""
    for wins in range(0, 25):
        for losses in range(0, 25):
            low, high = paired_gain_interval(wins, losses, 200, 0.05)
            assert low <= (wins - losses) / 200 <= high
            if wins + losses:
                assert (low > 0) == (sign_test_p(wins, losses) <= 0.05), (wins, losses)
    assert paired_gain_interval(0, 0, 200, 0.05) == (0.0, 0.0)


def test_the_paired_bootstrap_is_reproducible_and_brackets_the_mean():
    rng = np.random.default_rng(3)
    d = rng.normal(0.2, 1.0, size=200)
    mean = lambda x: x.mean(axis=1)  # noqa: E731
    low, high = bootstrap_interval(mean, [d], 0.05, 2000, seed=1)
    assert (low, high) == bootstrap_interval(mean, [d], 0.05, 2000, seed=1)
    assert low < d.mean() < high
    # about the normal-theory half width: 1.645 sd / sqrt(n)
    assert (high - low) / 2 == pytest.approx(1.645 * d.std() / np.sqrt(200), rel=0.15)


# -- decisions -------------------------------------------------------------------------------------


def test_gate_accepts_a_candidate_that_is_significantly_better_and_shows_the_interval():
    candidate, accepted = paired(wins=20, losses=2)
    decision = decide(GateConfig(), candidate, accepted)
    assert decision.accepted and decision.tasks == 102
    success = decision.checks[0]
    assert success.name == "held-out success" and success.low > 0
    assert success.estimate == pytest.approx(18 / 102)
    assert "on 102 paired tasks" in decision.reasons[0] and "[+" in decision.reasons[1]


def test_gate_refuses_an_identical_candidate_and_a_gain_within_the_noise():
    same, accepted = paired(wins=0, losses=0)
    decision = decide(GateConfig(), same, accepted)
    assert not decision.accepted and (decision.checks[0].low, decision.checks[0].high) == (0.0, 0.0)
    # +0.015 on 200 tasks, the kind make run used to accept: 8 won, 5 lost (one-sided p 0.29)
    noisy, accepted = paired(wins=8, losses=5, both=90, neither=97)
    decision = decide(GateConfig(), noisy, accepted)
    assert noisy.success - accepted.success == pytest.approx(0.015)
    assert not decision.accepted and "REFUSED" in decision.reasons[1]


def test_gate_refuses_when_the_minimum_gain_is_not_cleared_by_the_lower_bound():
    candidate, accepted = paired(wins=20, losses=2)
    assert not decide(GateConfig(min_success_gain=0.15), candidate, accepted).accepted


def test_gate_pairs_by_task_id_and_refuses_without_common_tasks():
    candidate, accepted = paired(wins=20, losses=2)
    shuffled = result(accepted.success, tasks=list(reversed(accepted.tasks)), version=0)
    assert decide(GateConfig(), candidate, shuffled).checks[0].estimate == pytest.approx(18 / 102)
    bare = result(0.3, tasks=[], version=0)
    decision = decide(GateConfig(), candidate, bare)
    assert not decision.accepted and "nothing to compare" in decision.reasons[0]


def test_gate_refuses_a_better_candidate_whose_invalid_tool_calls_rise_significantly_but_not_on_noise():
    candidate, accepted = paired(wins=20, losses=2)
    for i, t in enumerate(candidate.tasks):
        t.invalid_tool_calls = 1 if i % 3 == 0 else 0  # +0.33 per episode, on every third task
    decision = decide(GateConfig(), candidate, accepted)
    assert not decision.accepted
    assert any(c.name.startswith("invalid") and not c.passed and c.low > 0.05 for c in decision.checks)
    candidate, accepted = paired(wins=20, losses=2)
    candidate.tasks[0].invalid_tool_calls = 3  # +0.03 per episode from one task: within the limit
    assert decide(GateConfig(), candidate, accepted).accepted


def test_gate_refuses_any_rise_in_safety_violations_when_strict():
    candidate, accepted = paired(wins=20, losses=2)
    candidate.tasks[5].safety_violations = 1
    assert not decide(GateConfig(), candidate, accepted).accepted
    # one event is not significant
    assert decide(GateConfig(strict_safety=False), candidate, accepted).accepted


def test_gate_refuses_a_candidate_that_got_much_slower_or_regressed():
    candidate, accepted = paired(wins=20, losses=2)
    for t in candidate.tasks:
        t.time_s = 2.5
    decision = decide(GateConfig(), candidate, accepted)
    assert not decision.accepted and any(c.name.startswith("time") and not c.passed for c in decision.checks)
    candidate, accepted = paired(wins=20, losses=2)
    reg_c, reg_a = paired(wins=1, losses=12, both=20, neither=17, split="regression")
    decision = decide(GateConfig(), candidate, accepted, reg_c, reg_a)
    assert not decision.accepted and any("regression" in r and "REFUSED" in r for r in decision.reasons)
    reg_c, reg_a = paired(wins=2, losses=4, both=30, neither=14, split="regression")  # a drop of 0.04: noise
    assert decide(GateConfig(), candidate, accepted, reg_c, reg_a).accepted


def test_an_interim_look_refuses_a_clearly_worse_candidate_early_and_never_promotes():
    worse, accepted = paired(wins=1, losses=15, both=5, neither=5)
    early = interim(GateConfig(), worse, accepted)
    assert early is not None and early.early and not early.accepted and "refused early" in early.reasons[0]
    better, accepted = paired(wins=20, losses=0, both=5, neither=5)
    assert interim(GateConfig(), better, accepted) is None  # clearly better: evaluate the rest, decide then
    assert not decide(GateConfig(), better, accepted, final=False).accepted


def test_slices_cover_the_tasks_and_merge_joins_them():
    assert slices(200, 4) == [(0, 50), (50, 100), (100, 150), (150, 200)]
    assert slices(3, 4) == [(0, 1), (1, 2), (2, 3)]
    assert slices(10, 1) == [(0, 10)]
    a, b = result(0.5, n=10, time_s=1.0), result(1.0, n=30, time_s=3.0)
    b.tasks = [TaskOutcome(f"u{i}", True, 0, 0, 3.0) for i in range(30)]
    joined = merge([a, b])
    assert joined.episodes == 40 and len(joined.tasks) == 40
    assert joined.success == pytest.approx((5 + 30) / 40)
    assert joined.time_to_completion_s == pytest.approx(2.5)


# -- the false-promotion rate, simulated -------------------------------------------------------------


def test_an_equal_candidate_is_never_promoted_with_seeded_evaluations_and_rarely_without():
    config = GateConfig()
    # Same weights, same seeds: the same per-task results every time: never promoted.
    rate, _ = promotion_rate(config, gain=0.0, n_tasks=200, trials=300, coupled=True, seed=1)
    assert rate == 0.0
    # Same weights, fresh randomness each evaluation (the worst case): at most alpha, up to the
    # simulation's noise (1000 trials: sd 0.007 at 0.05).
    rate, _ = promotion_rate(config, gain=0.0, n_tasks=200, trials=1000, coupled=False, seed=2)
    print(f"false-promotion rate, equal candidates, unseeded: {rate:.3f}")
    assert rate <= config.alpha + 0.02
    # The old rule (any point gain above 0 on one evaluation) promotes about 45% of them.
    rng = np.random.default_rng(2)
    old = 0
    for _ in range(300):
        p = task_probabilities(rng, 200)
        old += (rng.random(200) < p).mean() > (rng.random(200) < p).mean()
    assert old / 300 > 0.35


def test_a_real_improvement_is_promoted():
    rate, _ = promotion_rate(GateConfig(), gain=0.10, n_tasks=200, trials=200, coupled=True, seed=3)
    assert rate >= 0.95
    rate, _ = promotion_rate(GateConfig(), gain=0.15, n_tasks=200, trials=200, coupled=False, seed=4)
    assert rate >= 0.8


def test_report_writes_summary_plots_and_html(tmp_path):
    record = RunRecord("r", "async", {}, 0.0, wall_s=60.0)
    record.evals = [result(0.3, label="baseline", version=0), result(0.6, label="final", version=8)]
    record.steps = [StepRecord(step=i, version=i, elapsed_s=i * 5.0, reward_mean=0.3 + i / 40)
                    for i in range(1, 9)]
    record.gate = [GateDecision(4, True, ["held-out success 0.300 -> 0.500 (+0.200)"], 20.0)]
    record.trajectories = [TrajectoryRecord(1.0 * i, 60, 20, float(i % 2), bool(i % 2), "completed",
                                            "train", i // 4, i % 3, 0.05, [0.1, 0.2]) for i in range(40)]
    record.weight_pauses_s = [0.001, 0.002]
    record.cpu = [(2.0, 80.0), (4.0, 90.0)]
    summary = write_report(record, tmp_path)
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["heldout_success_gain"] == summary["heldout_success_gain"]
    assert abs(summary["heldout_success_gain"] - 0.3) < 1e-9
    assert summary["staleness"]["max"] == 2
    assert summary["trajectories"]["train"] == 40
    page = (tmp_path / "report.html").read_text()
    assert "Baseline vs RL" in page and "report/reward_success.png" in page
    for png in ("reward_success.png", "rollout.png", "versions.png", "cpu.png"):
        assert (tmp_path / "report" / png).stat().st_size > 1000


def _episode(elapsed_s, passed, reasons, tools, invalid=0):
    return EpisodeRecord(elapsed_s, passed, reasons, tools, invalid, generate_s=0.4,
                         tool_s=0.2, sandbox_s=0.1, verify_s=1.0, episode_s=2.0)


def test_the_report_counts_tool_calls_by_tool_sandbox_time_and_failure_reasons_per_minute(tmp_path):
    record = RunRecord("r", "async", {}, 0.0, wall_s=130.0)
    record.episodes = [_episode(10.0, False, ["WRONG_ANSWER", "WRONG_ANSWER"], {"read_file": 1, "run": 1}),
                       _episode(50.0, False, ["NO_ANSWER"], {"read_file": 2}, invalid=1),
                       _episode(70.0, True, [], {"read_file": 1, "edit_file": 1, "run": 1}),
                       _episode(125.0, True, [], {"edit_file": 1})]
    figures = episode_figures(record.episodes)
    assert figures["tool_calls_by_tool"] == {"edit_file": 2, "read_file": 4, "run": 2}
    assert figures["tool_calls_per_episode"]["read_file"] == 1.0
    assert figures["invalid_tool_calls_per_episode"] == 0.25
    assert abs(figures["sandbox_s_per_episode"]["mean"] - 0.3) < 1e-9
    assert figures["phase_s_per_episode"]["verification"] == 1.0
    minutes = figures["verifier_reasons_over_time"]
    buckets = [(b["from_s"], b["episodes"], b["passed"]) for b in minutes]
    assert buckets == [(0.0, 2, 0), (60.0, 1, 1), (120.0, 1, 1)]
    assert minutes[0]["reasons"] == {"WRONG_ANSWER": 1, "NO_ANSWER": 1}  # an episode counts once per reason
    summary = write_report(record, tmp_path)
    assert summary["episodes"] == figures
    page = (tmp_path / "report.html").read_text()
    assert "Verifier failure reasons over time" in page and "edit_file" in page
    assert episode_figures([]) == {}
