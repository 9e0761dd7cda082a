import itertools
import json

import pytest

from rlfleet.verifier.kinds import (
    KIND_NAMES,
    Episode,
    ExactKind,
    LabelledEpisode,
    NumericKind,
    ReasonCode,
    ScoringConfig,
    TestRunResult,
    ToolCallRecord,
    UnitTestsKind,
    UnknownVerifierKind,
    Violation,
    audit,
    default_kinds,
    parse_number,
    run_locally,
)
from rlfleet.verifier.kinds.base import DEFAULT_MAX_TURNS
from rlfleet.verifier.kinds.turns import read_turns
from rlfleet.verifier.kinds.unit_tests import GRACE_S, _clean

CALC_TASK = {
    "task_id": "calc-2-abc",
    "suite": "calc",
    "split": "heldout",
    "messages": [{"role": "user", "content": "What is 37*48+5?"}],
    "verifier": {"kind": "numeric", "answer": "1781", "tolerance": 0.0},
    "tools": [{"name": "calc", "description": ""}],
    "limits": {"max_turns": 3},
}
EXACT_TASK = {
    **CALC_TASK,
    "task_id": "capital",
    "verifier": {"kind": "exact", "answer": "New  York"},
    "tools": [],
}
CODE_TASK = {
    "task_id": "code-fizzbuzz",
    "suite": "code",
    "split": "train",
    "prompt": "Write fizzbuzz in solution.py",
    "verifier": {
        "kind": "unit_tests",
        "tests": "HIDDEN",
        "test_file": "test_hidden.py",
        "solution_files": ["solution.py"],
        "timeout_s": 5,
    },
    "tools": [{"name": "write_file"}, {"name": "python"}],
    "limits": {"max_turns": 6},
}


def calc_episode(*texts, records=(), **fields):
    return Episode(assistant_texts=list(texts), tool_calls=list(records), **fields)


def ideal(answer="1781"):
    return calc_episode(
        "<calc>37*48+5</calc>",
        f"<answer>{answer}</answer>",
        records=[ToolCallRecord("calc", "37*48+5", "1781")],
    )


def score(task, episode, **kinds):
    return default_kinds(**kinds).score(task, episode)


# --- numeric and exact ---------------------------------------------------------------------------


def test_the_ideal_calc_episode_passes_with_full_reward_and_no_reasons():
    verdict = score(CALC_TASK, ideal())
    assert (verdict.passed, verdict.reward, verdict.reasons, verdict.kind) == (True, 1.0, [], "numeric")


@pytest.mark.parametrize(
    "answer", ["1781", " 1781 ", "1,781", "1781.0", "1781.", "+1781", "1.781e3", "\n1781\n"]
)
def test_numeric_accepts_the_same_number_written_differently(answer):
    assert score(CALC_TASK, ideal(answer)).passed


@pytest.mark.parametrize(
    "answer", ["1780", "17,81", "1781 apples", "one thousand", "", "NaN", "inf", "1781/1", "--1781"]
)
def test_numeric_rejects_other_numbers_and_non_numbers_as_wrong_answers(answer):
    verdict = score(CALC_TASK, ideal(answer))
    assert not verdict.passed and verdict.reward == 0.0
    assert verdict.codes == [ReasonCode.WRONG_ANSWER]
    assert verdict.reasons[0].details == {"expected": "1781", "got": answer.strip()}


def test_numeric_handles_negative_answers_unicode_minus_and_tolerance():
    negative = {**CALC_TASK, "verifier": {"kind": "numeric", "answer": "-33"}}
    assert score(negative, calc_episode("<answer>-33</answer>")).passed
    assert score(negative, calc_episode("<answer>\u221233</answer>")).passed
    assert not score(negative, calc_episode("<answer>33</answer>")).passed
    approximate = {**CALC_TASK, "verifier": {"kind": "numeric", "answer": "3.14159", "tolerance": 0.01}}
    assert score(approximate, calc_episode("<answer>3.14</answer>")).passed
    assert not score(approximate, calc_episode("<answer>3.1</answer>")).passed


def test_parse_number_is_exact_and_strict_about_thousands_separators():
    assert parse_number("1,234,567.5") == parse_number("1234567.5")
    assert parse_number("0.1") + parse_number("0.2") == parse_number("0.3")
    assert parse_number("1,23") is None and parse_number(",") is None and parse_number("-") is None


def test_exact_normalises_whitespace_and_case_unless_told_otherwise():
    assert score(EXACT_TASK, calc_episode("<answer>  new york </answer>")).passed
    assert not score(EXACT_TASK, calc_episode("<answer>NewYork</answer>")).passed
    strict = {**EXACT_TASK, "verifier": {"kind": "exact", "answer": "New York", "case_sensitive": True}}
    assert not score(strict, calc_episode("<answer>new york</answer>")).passed
    assert score(strict, calc_episode("<answer>New\tYork</answer>")).passed


def test_an_episode_without_an_answer_fails_with_no_answer():
    verdict = score(
        CALC_TASK,
        calc_episode(
            "<calc>37*48+5</calc>", "I am not sure.", records=[ToolCallRecord("calc", "37*48+5", "1781")]
        ),
    )
    assert (verdict.passed, verdict.codes) == (False, [ReasonCode.NO_ANSWER])


def test_the_first_answer_of_the_episode_counts_and_later_ones_are_ignored():
    assert not score(CALC_TASK, calc_episode("<answer>1780</answer><answer>1781</answer>")).passed
    assert not score(CALC_TASK, calc_episode("<answer>1780</answer>", "<answer>1781</answer>")).passed
    assert score(CALC_TASK, calc_episode("<answer>1781</answer>", "<answer>0</answer>")).passed


def test_only_the_first_tag_of_a_turn_counts_so_an_answer_after_a_call_in_the_same_turn_is_ignored():
    verdict = score(
        CALC_TASK,
        calc_episode(
            "<calc>37*48+5</calc><answer>1781</answer>", records=[ToolCallRecord("calc", "37*48+5", "1781")]
        ),
    )
    assert verdict.codes == [ReasonCode.NO_ANSWER]


def test_without_assistant_texts_the_bare_answer_is_scored():
    assert score(CALC_TASK, Episode(answer=" 1,781 ")).passed
    assert score(CALC_TASK, Episode()).codes == [ReasonCode.NO_ANSWER]
    # With texts the verifier reads them and ignores a client's parse.
    assert not score(CALC_TASK, calc_episode("<answer>5</answer>", answer="1781")).passed


# --- shared rules: tool calls, safety, time ------------------------------------------------------


@pytest.mark.parametrize(
    ("turn", "message"),
    [
        ("<python>print(1)</python>", "unknown tool 'python'"),
        ("<calc>37*48+5", "malformed tool call: <calc> is not a closed pair"),
        ("<calc>37*48+5</answer>", "malformed tool call: <calc> is not a closed pair"),
        ("37*48+5</calc>", "malformed tool call: </calc> is not a closed pair"),
    ],
)
def test_unknown_tools_and_malformed_tags_are_invalid_tool_calls_that_cost_a_small_penalty(turn, message):
    episode = calc_episode(
        turn,
        "<calc>37*48+5</calc>",
        "<answer>1781</answer>",
        records=[ToolCallRecord("calc", "37*48+5", "1781")],
    )
    verdict = score(CALC_TASK, episode)
    assert verdict.passed and verdict.reward == pytest.approx(0.95)
    assert verdict.codes == [ReasonCode.INVALID_TOOL_CALL]
    assert verdict.reasons[0].message == message and verdict.reasons[0].details["turn"] == "0"


def test_a_call_the_sandbox_answered_with_an_error_is_invalid():
    episode = calc_episode(
        "<calc>37*48+</calc>",
        "<calc>37*48+5</calc>",
        "<answer>1781</answer>",
        records=[
            ToolCallRecord("calc", "37*48+", "error: unexpected end of expression", ok=False),
            ToolCallRecord("calc", "37*48+5", "1781"),
        ],
    )
    verdict = score(CALC_TASK, episode)
    assert verdict.codes == [ReasonCode.INVALID_TOOL_CALL]
    assert verdict.reasons[0].details == {
        "turn": "0",
        "tool": "calc",
        "text": "error: unexpected end of expression",
    }


def test_calls_beyond_max_turns_are_invalid_and_the_penalty_is_capped():
    calls = ["<calc>1+1</calc>"] * 8
    records = [ToolCallRecord("calc", "1+1", "2")] * 3
    verdict = score(CALC_TASK, calc_episode(*calls, "<answer>1781</answer>", records=records))
    assert verdict.codes == [ReasonCode.INVALID_TOOL_CALL] * 5
    assert verdict.reasons[0].message == "tool call 4 exceeds max_turns=3"
    assert verdict.passed and verdict.reward == pytest.approx(0.8)
    failed = score(CALC_TASK, calc_episode(*calls, "<answer>0</answer>", records=records))
    assert failed.reward == pytest.approx(-0.2)


def test_a_safety_violation_fails_the_episode_and_costs_a_penalty_but_resource_limits_do_not():
    unsafe = ideal()
    unsafe.violations.append(Violation("network", "connect to 1.1.1.1:443"))
    verdict = score(CALC_TASK, unsafe)
    assert (verdict.passed, verdict.reward, verdict.codes) == (
        False,
        pytest.approx(-0.2),
        [ReasonCode.SAFETY_VIOLATION],
    )
    assert verdict.reasons[0].details == {"kind": "network", "message": "connect to 1.1.1.1:443"}
    limited = ideal()
    limited.violations.append(Violation("memory", "256 MiB"))
    assert score(CALC_TASK, limited).passed


def test_a_timed_out_episode_fails_and_a_truncated_one_without_answer_says_so():
    assert score(CALC_TASK, calc_episode("<answer>1781</answer>", timed_out=True)).codes == [
        ReasonCode.TIMEOUT
    ]
    truncated = score(CALC_TASK, calc_episode("<calc>1+1</calc>", truncated=True))
    assert truncated.codes == [ReasonCode.NO_ANSWER, ReasonCode.TRUNCATED]


def test_penalties_and_rewards_are_configurable():
    config = ScoringConfig(
        pass_reward=2.0, fail_reward=-1.0, invalid_tool_call_penalty=0.5, max_invalid_tool_call_penalty=0.5
    )
    kinds = default_kinds(config=config)
    assert kinds.score(
        CALC_TASK, calc_episode("<foo>x</foo>", "<answer>1781</answer>")
    ).reward == pytest.approx(1.5)
    assert kinds.score(CALC_TASK, calc_episode("<answer>1</answer>")).reward == pytest.approx(-1.0)


# --- unit_tests ----------------------------------------------------------------------------------


class FakeRunner:
    """Answers every run with the report a supervisor would print (with the request's nonce) plus `extra`."""

    def __init__(self, report=None, extra="", exit_code=0, timed_out=False):
        self.report, self.extra, self.exit_code, self.timed_out = report, extra, exit_code, timed_out
        self.requests = []

    def __call__(self, request):
        self.requests.append(request)
        output = self.extra
        if self.report is not None:
            nonce = json.loads(request.stdin)["nonce"]
            output += f"RLFLEET-HARNESS-REPORT {nonce} {json.dumps(self.report)}\n"
        return TestRunResult(self.exit_code, output, timed_out=self.timed_out)


def report(*lines, exit_code=0, protected=True, outcomes=None, failures=()):
    rows = [{"text": text, "outcomes": list(codes)} for text, *codes in lines]
    return {"protected": protected, "exit_code": exit_code, "error": "", "calls": len(rows),
            "outcomes": outcomes or {}, "failures": list(failures), "lines": rows}


def code_episode(**files):
    return Episode(
        assistant_texts=["<write_file>solution.py\n...</write_file>", "<answer>done</answer>"], files=files
    )


def test_unit_tests_pass_on_a_clean_report_and_send_only_the_declared_files_and_the_tests_on_stdin():
    runner = FakeRunner(report(("PASS test_a", "ok"), ("PASS test_b", "ok"), ("RESULT passed=2 failed=0",)))
    verdict = score(
        CODE_TASK,
        code_episode(**{"solution.py": "def f(): ...", "conftest.py": "evil", "test_hidden.py": "fake"}),
        runner=runner,
    )
    assert (verdict.passed, verdict.reward, verdict.kind) == (True, 1.0, "unit_tests")
    (request,) = runner.requests
    assert request.files == {"solution.py": "def f(): ..."} and request.timeout_s == 5.0 + GRACE_S
    job = json.loads(request.stdin)
    assert (job["tests"], job["modules"], job["timeout_s"]) == ("HIDDEN", ["solution"], 5.0)
    assert len(job["nonce"]) == 32 and request.argv[:3] == ("python3", "-I", "-c")


def test_failures_carry_codes_by_the_calls_before_them_and_no_hidden_text():
    verdict = score(CODE_TASK, code_episode(**{"solution.py": ""}), runner=FakeRunner(report(
        ("PASS test_fizzbuzz_0", "ok"),
        ("FAIL test_fizzbuzz_1: fizzbuzz(5,) returned '5', expected 'Buzz'", "ok"),
        ("FAIL test_fizzbuzz_2: ZeroDivisionError: x", "EXCEPTION"),
        ("FAIL test_fizzbuzz_3: CandidateTimeout", "TIMEOUT"),
        ("RESULT passed=1 failed=3",), exit_code=1,
        failures=[{"code": "EXCEPTION", "detail": "ZeroDivisionError"}])))
    assert verdict.codes == [ReasonCode.WRONG_ANSWER, ReasonCode.EXCEPTION, ReasonCode.TIMEOUT]
    assert [r.details["test"] for r in verdict.reasons] == ["1", "2", "3"]
    assert verdict.reasons[1].details["exception"] == "ZeroDivisionError"
    assert "Buzz" not in repr(verdict.reasons) and "fizzbuzz" not in repr(verdict.reasons)


def test_exception_text_that_quotes_the_hidden_tests_is_masked():
    hidden = "CASES = [([15], 'FizzBuzz'), ([7], 'seven thousand')]"
    masked = _clean("leaked:([7], 'seven thousand')", hidden)
    assert masked == "leaked:" + "*" * 23, masked
    assert _clean("ValueError", hidden) == "ValueError"


@pytest.mark.parametrize(
    ("runner", "code", "failure"),
    [
        (FakeRunner(None, "PASS t\nRESULT passed=5 failed=0\n"), ReasonCode.TEST_FAILED, "NO_REPORT"),
        (FakeRunner(report(("RESULT passed=1 failed=0",)), "RLFLEET-HARNESS-REPORT 00 {}\n"),
         ReasonCode.REWARD_HACKING, "FORGED_REPORT"),
        (FakeRunner(None, timed_out=True, exit_code=-9), ReasonCode.TIMEOUT, "TIMEOUT"),
        (FakeRunner(report(("RESULT passed=1 failed=0",), protected=False)), ReasonCode.VERIFIER_ERROR,
         "UNPROTECTED"),
        (FakeRunner(report(("RESULT passed=0 failed=0",))), ReasonCode.TEST_FAILED, "NO_PASS"),
        (FakeRunner(report(("RESULT passed=1 failed=0",), exit_code=2)), ReasonCode.TEST_FAILED,
         "EXIT_STATUS"),
        (FakeRunner(report(("PASS t", "ok"), ("RESULT passed=1 failed=0",), outcomes={"REWARD_HACKING": 1})),
         ReasonCode.REWARD_HACKING, "REWARD_HACKING"),
    ],
)
def test_a_run_without_a_clean_report_of_its_own_fails(runner, code, failure):
    verdict = score(CODE_TASK, code_episode(**{"solution.py": ""}), runner=runner)
    assert not verdict.passed and verdict.codes == [code] and verdict.reasons[0].details["failure"] == failure


def test_a_missing_solution_is_no_answer_without_a_run():
    runner = FakeRunner(report(("RESULT passed=1 failed=0",)))
    missing = score(CODE_TASK, code_episode(**{"solutions.py": ""}), runner=runner)
    assert missing.codes == [ReasonCode.NO_ANSWER] and runner.requests == []


def test_too_many_failing_tests_are_summarised():
    lines = [(f"FAIL test_{i}: no", "ok") for i in range(30)]
    verdict = UnitTestsKind(FakeRunner(report(*lines, ("RESULT passed=0 failed=30",), exit_code=1))).score(
        CODE_TASK, code_episode(**{"solution.py": ""})
    )
    assert len(verdict.reasons) == 21 and verdict.reasons[-1].message == "and 10 more failing tests"


# --- dispatch ------------------------------------------------------------------------------------


def test_a_task_is_scored_by_the_kind_it_names_and_an_unconfigured_kind_is_an_error():
    with pytest.raises(UnknownVerifierKind, match="no verifier kind 'unit_tests' is configured"):
        score(CODE_TASK, code_episode())
    with pytest.raises(UnknownVerifierKind, match="'regex'"):
        score({**CALC_TASK, "verifier": {"kind": "regex"}}, ideal())
    with pytest.raises(ValueError, match="not 'exact'"):
        ExactKind().score(CALC_TASK, ideal())


# --- audit ---------------------------------------------------------------------------------------


def test_audit_counts_agreement_with_human_labels_and_lists_the_disagreements():
    labelled = [
        LabelledEpisode(CALC_TASK, ideal(), human_passed=True, episode_id="e1"),  # TP
        LabelledEpisode(CALC_TASK, ideal("1,781"), human_passed=True, episode_id="e2"),  # TP
        LabelledEpisode(CALC_TASK, ideal("1780"), human_passed=False, episode_id="e3"),  # TN
        LabelledEpisode(
            CALC_TASK, ideal("1781.0"), human_passed=False, episode_id="e4"
        ),  # FP: a strict labeller
        LabelledEpisode(CALC_TASK, calc_episode("no idea"), human_passed=False, episode_id="e5"),  # TN
        LabelledEpisode(
            CALC_TASK, ideal("1 781"), human_passed=True, episode_id="e6"
        ),  # FN: a lenient labeller
        LabelledEpisode(CALC_TASK, ideal("-1781"), human_passed=False, episode_id="e7"),  # TN
    ]
    report = audit(NumericKind(), labelled)
    assert (report.n, report.tp, report.fp, report.tn, report.fn) == (7, 2, 1, 3, 1)
    assert report.false_positive_rate == pytest.approx(1 / 4)  # FP / (FP + TN)
    assert report.false_negative_rate == pytest.approx(1 / 3)  # FN / (FN + TP)
    assert [(d.episode_id, d.task_id, d.human_passed, d.verifier_passed) for d in report.disagreements] == [
        ("e4", "calc-2-abc", False, True),
        ("e6", "calc-2-abc", True, False),
    ]
    assert report.disagreements[1].reasons[0].code == ReasonCode.WRONG_ANSWER


def test_audit_of_nothing_has_zero_rates():
    report = audit(default_kinds(), [])
    assert (report.n, report.false_positive_rate, report.false_negative_rate) == (0, 0.0, 0.0)


# --- contract with the environment SDK (rlfleet.envkit) -------------------------------------------


def test_kind_names_and_defaults_match_the_suite_format():
    suite_format = pytest.importorskip("rlfleet.envkit.suite_format")
    assert set(KIND_NAMES) == set(suite_format.VERIFIER_KINDS)
    assert DEFAULT_MAX_TURNS == suite_format.Limits().max_turns


@pytest.mark.parametrize(
    "turn",
    [
        "<calc>1+2</calc>",
        "<answer> 3 </answer>",
        "<calc>1+2",
        "1+2</calc>",
        "<calc>1</answer>",
        "<python>x</python>",
        "no tags",
        "<answer>1</answer><calc>2</calc>",
        "<calc>2</calc><answer>1</answer>",
        "<answer>3",
    ],
)
def test_the_verifier_reads_a_turn_exactly_as_the_rollout_worker_does(turn):
    actions = pytest.importorskip("rlfleet.envkit.actions")
    action = actions.parse_action(turn, ["calc"])
    reading = read_turns(Episode(assistant_texts=[turn]), ["calc"], max_turns=3)
    assert reading.answer == (action.answer if isinstance(action, actions.FinalAnswer) else None)
    assert len(reading.invalid) == (1 if isinstance(action, actions.InvalidCall) else 0)


def test_built_in_calc_demos_score_as_their_flaws_say():
    pytest.importorskip("rlfleet.envkit")
    from rlfleet.envkit.actions import ToolCall, parse_action
    from rlfleet.envkit.demos import generate_demos
    from rlfleet.envkit.suites import calc

    tasks = {t.task_id: t for t in calc.generate_tasks("train", 400, seed=5, difficulty=2)}
    for demo in generate_demos(400, seed=5, imperfection=0.8, difficulty=2):
        messages = demo["messages"]
        texts = [m["content"] for m in messages if m["role"] == "assistant"]
        records = [
            ToolCallRecord(
                call.tool, call.args, reply["content"], ok=not reply["content"].startswith("error:")
            )
            for sent, reply in itertools.pairwise(messages)
            if sent["role"] == "assistant"
            and isinstance(call := parse_action(sent["content"], ["calc"]), ToolCall)
        ]
        verdict = score(tasks[demo["task_id"]], Episode(assistant_texts=texts, tool_calls=records))
        if demo["flaw"] == "none":
            assert (verdict.passed, verdict.reward, verdict.reasons) == (True, 1.0, [])
        elif demo["flaw"] in ("wrong_expression", "answer_typo"):
            assert verdict.codes == [ReasonCode.WRONG_ANSWER]
        elif demo["flaw"] == "malformed_call":
            assert ReasonCode.INVALID_TOOL_CALL in verdict.codes and verdict.reward < 1.0
        else:
            assert verdict.codes in ([], [ReasonCode.WRONG_ANSWER])


def test_built_in_code_tasks_pass_with_the_reference_and_fail_with_numbered_tests_otherwise():
    pytest.importorskip("rlfleet.envkit")
    from rlfleet.envkit.suites import code

    task = next(
        t
        for t in code.generate_tasks("train") + code.generate_tasks("heldout")
        if t.task_id == "code-fizzbuzz"
    )
    kinds = default_kinds(runner=run_locally)
    assert kinds.score(task, code_episode(**{"solution.py": code.reference_solution(task)})).passed
    wrong = kinds.score(task, code_episode(**{"solution.py": "def fizzbuzz(n):\n    return 'Fizz'\n"}))
    assert [(r.code, r.details["test"]) for r in wrong.reasons] == [
        (ReasonCode.WRONG_ANSWER, str(i)) for i in range(1, 5)
    ]


def test_a_safety_violation_of_the_hidden_test_run_fails_a_clean_report():
    runner = FakeRunner(report(("PASS t", "ok"), ("RESULT passed=1 failed=0",)))
    original = runner.__call__

    def with_violations(request):
        result = original(request)
        return TestRunResult(result.exit_code, result.output, violations=("network", "memory"))

    verdict = UnitTestsKind(with_violations).score(CODE_TASK, code_episode(**{"solution.py": ""}))
    assert verdict.codes == [ReasonCode.SAFETY_VIOLATION] and verdict.reasons[0].details["kind"] == "network"


# Hacks that are harmless to run on this host without a sandbox (the rest need its pid namespace,
# uid and limits: tests/integration/test_reward_hacking.py runs every one of them there).
LOCAL_HACKS = ("fake_result_lines", "result_line_in_an_exception", "os_exit_zero_at_import",
               "os_exit_zero_in_call", "exit_in_atexit", "eq_always_true", "str_subclass_eq",
               "patched_builtins", "patched_math", "raise_with_hidden_text", "plant_modules_for_the_harness",
               "inspect_the_caller", "system_exit_in_call", "sleep_to_the_timeout")


@pytest.mark.parametrize("name", LOCAL_HACKS)
def test_hacks_score_zero_with_their_reason_under_the_local_supervisor(name):
    from rlfleet.envkit.suites import code
    from rlfleet.envkit.suites.code_templates import TEMPLATES
    from rlfleet.verifier.hacks import HACKS

    template = next(t for t in TEMPLATES if t.function == "fizzbuzz")
    task = code.make_task(template).model_dump(mode="json")
    task["verifier"]["timeout_s"] = 2.0
    hack = next(h for h in HACKS if h.name == name)
    verdict = default_kinds(runner=run_locally).score(
        task, code_episode(**{"solution.py": hack.write(template.function, template.solution)}))
    assert not verdict.passed and verdict.reward == 0.0 and hack.code in verdict.codes, verdict
    assert "Buzz" not in repr(verdict.reasons) and "CASES" not in repr(verdict.reasons)


def test_the_hacks_that_look_for_the_tests_would_answer_right_from_them():
    from rlfleet.envkit.suites import code
    from rlfleet.envkit.suites.code_templates import TEMPLATES
    from rlfleet.verifier import hacks

    template = next(t for t in TEMPLATES if t.function == "fizzbuzz")
    namespace: dict = {}
    exec(hacks._ANSWER_FROM_FOUND, namespace)
    assert namespace["_answer_from"](["junk", code.build_test_script(template)], (5,)) == (True, "Buzz")
    assert namespace["_answer_from"](["junk"], (5,)) == (False, None)


def test_a_hidden_test_that_expects_the_candidate_to_raise_a_builtin_error_catches_it():
    tests = ("from solution import root\n"
             "try:\n    root(-1)\n    ok = False\nexcept ValueError:\n    ok = True\n"
             "ok = ok and root(9) == 3\n"
             "print('PASS t' if ok else 'FAIL t: no')\n"
             "print(f'RESULT passed={int(ok)} failed={int(not ok)}')\n")
    task = dict(CODE_TASK, verifier={"kind": "unit_tests", "tests": tests, "solution_files": ["solution.py"]})
    right = ("def root(x):\n    if x < 0:\n        raise ValueError('negative')\n    return int(x ** 0.5)\n")
    assert score(task, code_episode(**{"solution.py": right}), runner=run_locally).passed
    wrong = right.replace("ValueError", "KeyError")
    failed = score(task, code_episode(**{"solution.py": wrong}), runner=run_locally)
    assert failed.codes == [ReasonCode.EXCEPTION] and failed.reasons[0].details["exception"] == "KeyError"
