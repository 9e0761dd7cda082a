import json
import math

from rlfleet.api.verifier.v1 import verifier_pb2
from rlfleet.cli.report import EvalResult, RunRecord, TaskOutcome, TrajectoryRecord
from rlfleet.cli.run_state import eval_from_dict
from rlfleet.cli.stop_rules import AuditConfig, LongTailConfig, audit_result, audit_subset, long_tail


def labels():
    out = []
    for suite, n_pass, n_fail in (("calc", 30, 30), ("code", 10, 40)):
        out += [{"episode_id": f"{suite}-p{i}", "suite": suite, "task_id": "t", "human_passed": True}
                for i in range(n_pass)]
        out += [{"episode_id": f"{suite}-f{i}", "suite": suite, "task_id": "t", "human_passed": False}
                for i in range(n_fail)]
    return out


def test_the_audit_subset_is_fixed_by_its_seed_and_covers_every_suite_and_label():
    chosen = audit_subset(labels(), 12, seed=0)
    assert len(chosen) == 12 and chosen == audit_subset(labels(), 12, seed=0)
    assert chosen != audit_subset(labels(), 12, seed=1)
    strata = {(c["suite"], c["human_passed"]) for c in chosen}
    assert strata == {("calc", True), ("calc", False), ("code", True), ("code", False)}
    assert len(audit_subset(labels(), 1000, seed=0)) == len(labels())


def report(fp_rate_code=0.0, fn_rate=0.0):
    return verifier_pb2.AuditReport(
        n=40, false_positive_rate=fp_rate_code / 2, false_negative_rate=fn_rate,
        suites=[verifier_pb2.SuiteAudit(suite="calc", n=20, false_positive_rate=0.0,
                                        false_negative_rate=fn_rate),
                verifier_pb2.SuiteAudit(suite="code", n=20, false_positive_rate=fp_rate_code,
                                        false_negative_rate=0.0)],
        disagreements=[verifier_pb2.Disagreement(episode_id="code-hack-exit-gcd", human_passed=False,
                                                 verifier_passed=True)] if fp_rate_code else [])


def test_an_audit_breaches_when_a_suite_passes_a_hack_and_not_when_it_agrees():
    clean = audit_result(report(), "before the loop", AuditConfig())
    assert clean.breaches == [] and "false positive rate 0.000" in clean.line()
    fooled = audit_result(report(fp_rate_code=0.1), "before promoting version 5", AuditConfig())
    assert any("suite 'code'" in b and "passes 10.0%" in b for b in fooled.breaches)
    assert any("the audit set" in b for b in fooled.breaches)
    assert fooled.disagreements == ["code-hack-exit-gcd (label failed, verifier passed)"]
    lenient = AuditConfig(max_false_positive_rate=0.2)
    assert audit_result(report(fp_rate_code=0.1), "x", lenient).breaches == []
    assert audit_result(report(fn_rate=0.1), "x", AuditConfig()).breaches  # 10% > 5% false negatives


def trajectory(status="completed", generated=100, staleness=0, split="train"):
    return TrajectoryRecord(0.0, 150, generated, 1.0, True, status, split, 0, staleness, 0.0, [])


def test_the_long_tail_is_accounted_by_kind_against_the_held_out_gain():
    trajectories = ([trajectory() for _ in range(80)] + [trajectory("aborted") for _ in range(5)]
                    + [trajectory("truncated") for _ in range(3)]
                    + [trajectory(staleness=9) for _ in range(2)]
                    # evaluations are not rollouts
                    + [trajectory("aborted", split="heldout") for _ in range(7)])
    config = LongTailConfig(max_tokens_per_point=100, min_tokens=0)
    account = long_tail(trajectories, max_staleness=4, eval_retried=2, gain=0.10, config=config)
    assert account.trajectories == {"aborted": 5, "failed": 0, "truncated": 3, "stale": 2, "retried": 2}
    assert account.tokens["aborted"] == 500 and account.tokens["stale"] == 200
    assert account.tokens["retried"] == 200
    assert account.total_tokens == 9000 and account.gain_points == 10.0
    assert account.tokens_per_point == 1200 / 10 and account.fired and "above 100" in account.message
    assert not long_tail(trajectories, max_staleness=4, eval_retried=0, gain=0.10,
                         config=LongTailConfig(max_tokens_per_point=1000, min_tokens=0)).fired


def test_a_long_tail_without_gain_fires_once_it_costs_enough():
    trajectories = [trajectory("truncated", generated=50) for _ in range(10)]
    small = long_tail(trajectories, max_staleness=4, eval_retried=0, gain=0.0,
                      config=LongTailConfig(min_tokens=1000))
    assert math.isinf(small.tokens_per_point) and not small.fired  # 500 tokens: below min_tokens
    big = long_tail(trajectories, max_staleness=4, eval_retried=0, gain=-0.02,
                    config=LongTailConfig(min_tokens=100))
    assert big.fired and "no held-out gain" in big.message and big.as_dict()["tokens_per_point"] is None
    assert not long_tail(trajectories, max_staleness=4, eval_retried=0, gain=0.0,
                         config=LongTailConfig(enabled=False, min_tokens=0)).fired


def test_per_task_results_survive_the_run_state_round_trip():
    from dataclasses import asdict

    result = EvalResult(3, "heldout", 2, 0.5, 0.0, 0.0, 1.0, 2.0, 9.0, "candidate",
                        tasks=[TaskOutcome("a", True, 0, 0, 1.0),
                               TaskOutcome("b", False, 1, 0, 1.0)], retried=1)
    again = eval_from_dict(asdict(result))
    assert again == result and isinstance(again.tasks[0], TaskOutcome)


def test_rlfleet_status_shows_the_stop_rules_the_run_wrote(tmp_path):
    import json

    from rlfleet.cli.status_view import _stop_rule_lines, stop_rules

    assert stop_rules(tmp_path) == {}
    (tmp_path / "run_state.json").write_text(json.dumps({"record": {
        "audits": [{"when": "before the loop", "n": 40, "false_positive_rate": 0.0,
                    "false_negative_rate": 0.0}],
        "long_tail": {"message": "the long tail cost 30000 generated tokens"},
        "stop_rule": "the long tail cost 30000 generated tokens: no held-out gain, above 5000"}}))
    lines = _stop_rule_lines(stop_rules(tmp_path), lambda text, ok: text)
    assert any("before the loop: n 40" in line for line in lines)
    assert any(line.strip().startswith("FIRED: the long tail") for line in lines)


def test_the_trainer_drop_counters_are_read_by_reason():
    from rlfleet.cli.loop_watch import trainer_dropped

    page = """# HELP rlfleet_trainer_dropped_trajectories_total trajectories not trained, by reason
# TYPE rlfleet_trainer_dropped_trajectories_total counter
rlfleet_trainer_dropped_trajectories_total{job="trainer",reason="stale"} 12.0
rlfleet_trainer_dropped_trajectories_total{job="trainer",reason="uniform_rewards"} 30.0
rlfleet_trainer_data_wait_seconds_total 4.5
"""
    assert trainer_dropped(page) == {"stale": 12.0, "uniform_rewards": 30.0}
    assert trainer_dropped("rlfleet_trainer_data_wait_seconds_total 4.5\n") == {}


def test_an_audit_draws_from_the_verifier_kinds_the_run_scores_with_unless_its_scope_is_all(tmp_path):
    """A calc run's rewards come from the numeric kind only: its audits leave out the unit-test
    episodes (a sandbox and seconds of tests each), and keep them with `scope = "all"`."""
    from rlfleet.cli.run_config import RunConfig
    from rlfleet.cli.run_context import LoopContext
    from rlfleet.cli.stop_checks import StopChecks
    from rlfleet.envkit.submit import write_for_verifier
    from rlfleet.envkit.suites import generate_tasks

    where = tmp_path / "audit_set"
    calc, code = generate_tasks("calc", "heldout", 4), generate_tasks("code", "heldout", 4)
    write_for_verifier(calc + code, where / "suites")
    (where / "labels.jsonl").write_text("".join(
        json.dumps({"episode_id": f"{t.task_id}-{ok}", "suite": t.suite, "task_id": t.task_id,
                    "human_passed": ok}) + "\n" for t in calc + code for ok in (True, False)))

    def drawn(kinds, scope):
        config = RunConfig.model_validate({"audit": {"scope": scope, "episodes": 12}})
        ctx = LoopContext(config, tmp_path, RunRecord("r", "async", {}, 0.0))
        return {(e["suite"], e["human_passed"]) for e in StopChecks(ctx, None, kinds=kinds).audit_set()}

    assert drawn({"numeric"}, "run") == {("calc", True), ("calc", False)}
    assert drawn({"unit_tests"}, "run") == {("code", True), ("code", False)}
    every = {("calc", True), ("calc", False), ("code", True), ("code", False)}
    assert drawn({"numeric"}, "all") == every
    assert drawn({"a kind no label has"}, "run") == every  # nothing of its own: the whole set
