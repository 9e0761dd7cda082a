"""The verifier as a real process, with a real sandbox manager and Redis: answers, hidden tests, sessions,
stored verdicts, audits and bad input.

The session server is the one part not run for real: `StoredSessions` below writes fixed `Session`
messages where the session server keeps them (its Redis hash per session), which is where the
verifier reads the episode it scores. tests/integration/test_trust.py and test_rollout_sessions.py
run the real session server in front of it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

import grpc
import pytest

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.sandbox.v1 import sandbox_pb2 as sbx
from rlfleet.api.sandbox.v1 import sandbox_pb2_grpc
from rlfleet.api.session.v1 import session_pb2
from rlfleet.api.verifier.v1 import verifier_pb2 as pb
from rlfleet.api.verifier.v1 import verifier_pb2_grpc
from rlfleet.common.chat import SPECIAL_TOKENS, render_messages
from rlfleet.common.grpc_server import channel as open_channel
from rlfleet.common.processes import BIN, ServiceProcess
from rlfleet.common.redis_store import key
from rlfleet.common.rich_errors import error_details
from rlfleet.common.testing import unique_run_id
from rlfleet.envkit.suite_format import write_suite
from rlfleet.envkit.suites import calc, code
from rlfleet.sandbox.testing import start_sandbox_manager

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("bwrap"), reason="needs root and bubblewrap"),
]

R = common_pb2.ReasonCode
CALC = calc.generate_tasks("train", 3)
CODE = code.generate_tasks("train", 1)[0]
SLOW_TESTS = ("import solution\nok = solution.ready() == 1\nprint('PASS t' if ok else 'FAIL t: not ready')\n"
              "print(f'RESULT passed={int(ok)} failed={int(not ok)}')\n")
MINI = {"task_id": "mini-sleepy", "suite": "mini", "split": "train", "prompt": "write solution.py",
        "verifier": {"kind": "unit_tests", "tests": SLOW_TESTS, "timeout_s": 1.5}}


# -- the sessions, where the session server keeps them -------------------------------------------


class StoredSessions:
    """Sessions written as the session server's store writes them (rlfleet.session.store: the Session
    proto and its owner in `rlfleet:<run>:session:<id>`); no owner: only a service or the operator
    (this test's caller) sees them."""

    def __init__(self, redis_url: str, run_id: str) -> None:
        import redis

        self.redis = redis.Redis.from_url(redis_url)
        self.run_id = run_id

    def __setitem__(self, session_id: str, session: session_pb2.Session) -> None:
        self.redis.hset(key(self.run_id, "session", session_id),
                        mapping={"session": session.SerializeToString(), "owner": b""})


def train_tokenizer(directory: Path):
    """A tiny byte-level BPE with the chat special tokens, like the platform's default tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [render_messages(t.chat_messages(), True) + "<calc>12*3</calc><answer>36</answer>" for t in CALC]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return tok


def make_session(tokenizer, session_id: str, task, *turns: tuple[str, str]) -> session_pb2.Session:
    """A session as the session server keeps it: the prompt, then GENERATED and OBSERVATION spans."""
    session = session_pb2.Session(session_id=session_id, task_id=task.task_id,
                                  state=session_pb2.SESSION_STATE_OPEN)

    def append(kind: int, text: str) -> None:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        start = len(session.token_ids)
        session.token_ids.extend(ids)
        session.loss_mask.extend([1 if kind == common_pb2.SPAN_KIND_GENERATED else 0] * len(ids))
        session.spans.append(common_pb2.Span(kind=kind, start=start, end=len(session.token_ids),
                                             finish_reason=common_pb2.FINISH_REASON_STOP))

    append(common_pb2.SPAN_KIND_PROMPT, render_messages(task.chat_messages(), add_generation_prompt=True))
    for role, text in turns:
        if role == "assistant":
            append(common_pb2.SPAN_KIND_GENERATED, text + "<|im_end|>")
        else:
            append(common_pb2.SPAN_KIND_OBSERVATION,
                   f"\n<|im_start|>tool\n{text}<|im_end|>\n<|im_start|>assistant\n")
    return session


# -- processes --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def platform(redis_url, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("verifier")
    run_id = unique_run_id("ver")
    suites = workdir / "suites"
    write_suite(CALC, suites / "calc-train.jsonl")
    write_suite([CODE], suites / "code" / "code-train.jsonl")
    (suites / "mini.jsonl").write_text(json.dumps(MINI) + "\n")
    tokenizer = train_tokenizer(workdir / "tokenizer")
    sessions = StoredSessions(redis_url, run_id)
    manager = start_sandbox_manager(redis_url, run_id, workdir)
    verifier = None
    try:
        verifier = ServiceProcess("rlfleet-verifier", workdir, config={
            "redis.url": redis_url, "run_id": run_id, "sandbox_address": manager.address,
            "suites_dir": str(suites), "tokenizer_path": str(workdir / "tokenizer")}).start(30.0)
        yield {"verifier": verifier, "manager": manager, "sessions": sessions, "tokenizer": tokenizer,
               "suites": suites, "workdir": workdir}
    finally:
        if verifier is not None:
            assert verifier.stop() == 0, verifier.log()[-2000:]
        assert manager.stop() == 0
        sessions.redis.close()


@pytest.fixture
async def verifier(platform):
    async with open_channel(platform["verifier"].address) as channel:
        yield verifier_pb2_grpc.VerifierServiceStub(channel)


@pytest.fixture
async def sandboxes(platform):
    async with open_channel(platform["manager"].address) as channel:
        yield sandbox_pb2_grpc.SandboxServiceStub(channel)


async def expect(code_: grpc.StatusCode, call, *words: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == code_, err.value
    for word in words:
        assert word in err.value.details(), err.value.details()


def codes(verdict) -> list[str]:
    return [R.Name(r.code).removeprefix("REASON_CODE_") for r in verdict.reasons]


def answer_of(task) -> str:
    return task.verifier.answer


# -- answers ----------------------------------------------------------------------------------


async def test_calc_answers_right_wrong_and_missing(verifier, sandboxes):
    task = CALC[0]
    right = await verifier.Verify(pb.VerifyRequest(suite="calc", task_id=task.task_id,
                                                   final_answer=answer_of(task)))
    assert ((right.passed, right.reward, list(right.reasons), right.verifier_kind)
            == (True, 1.0, [], "numeric"))
    assert right.task_id == task.task_id and right.verify_s > 0 and right.schema_version == 1

    wrong = await verifier.Verify(pb.VerifyRequest(suite="calc", task_id=task.task_id, final_answer="-1"))
    assert (wrong.passed, wrong.reward, codes(wrong)) == (False, 0.0, ["WRONG_ANSWER"])
    assert dict(wrong.reasons[0].details) == {"expected": answer_of(task), "got": "-1"}

    box = await sandboxes.CreateSandbox(sbx.CreateSandboxRequest())  # an episode that never answered
    missing = await verifier.Verify(pb.VerifyRequest(suite="calc", task_id=task.task_id,
                                                     sandbox_id=box.sandbox_id))
    assert (missing.passed, codes(missing)) == (False, ["NO_ANSWER"])
    await expect(grpc.StatusCode.INVALID_ARGUMENT,
                 verifier.Verify(pb.VerifyRequest(suite="calc", task_id=task.task_id)), "nothing to verify")


async def test_a_sandbox_safety_violation_fails_a_right_answer(verifier, sandboxes):
    box = await sandboxes.CreateSandbox(sbx.CreateSandboxRequest())
    await sandboxes.Exec(sbx.ExecRequest(sandbox_id=box.sandbox_id, argv=[
        "python3", "-c", "import socket; socket.create_connection(('10.255.255.1', 80), timeout=1)"]))
    task = CALC[1]
    verdict = await verifier.Verify(pb.VerifyRequest(suite="calc", task_id=task.task_id,
                                                     sandbox_id=box.sandbox_id, final_answer=answer_of(task)))
    assert (verdict.passed, verdict.reward, codes(verdict)) == (False, -0.2, ["SAFETY_VIOLATION"])
    assert verdict.reasons[0].details["kind"] == "network"


# -- sessions ---------------------------------------------------------------------------------


async def test_a_session_is_scored_from_its_own_tokens_and_the_verdict_is_stored(platform, verifier):
    task, tokenizer = CALC[2], platform["tokenizer"]
    expression = task.metadata["expression"]
    platform["sessions"]["s-right"] = make_session(
        tokenizer, "s-right", task,
        ("assistant", "<calculator>1+1</calculator>"),
        ("tool", "error: unknown tool 'calculator'; available: calc"),
        ("assistant", f"<calc>{expression}</calc>"), ("tool", answer_of(task)),
        ("assistant", f"<answer>{answer_of(task)}</answer>"), ("assistant", "<answer>0</answer>"))
    verdict = await verifier.Verify(pb.VerifyRequest(session_id="s-right", suite="calc"))
    assert (verdict.passed, verdict.reward, codes(verdict)) == (True, 0.95, ["INVALID_TOOL_CALL"])
    assert verdict.session_id == "s-right" and verdict.task_id == task.task_id
    assert await verifier.GetVerdict(pb.GetVerdictRequest(session_id="s-right")) == verdict

    platform["sessions"]["s-silent"] = make_session(
        tokenizer, "s-silent", task, ("assistant", f"<calc>{expression}</calc>"), ("tool", answer_of(task)),
        ("assistant", "I think I am done."))
    silent = await verifier.Verify(pb.VerifyRequest(session_id="s-silent", suite="calc",
                                                    task_id=task.task_id))
    assert (silent.passed, codes(silent)) == (False, ["NO_ANSWER"])
    stored = await verifier.GetVerdict(pb.GetVerdictRequest(session_id="s-silent"))
    assert codes(stored) == ["NO_ANSWER"]

    await expect(grpc.StatusCode.NOT_FOUND,
                 verifier.GetVerdict(pb.GetVerdictRequest(session_id="s-never")), "s-never")
    await expect(grpc.StatusCode.NOT_FOUND,
                 verifier.Verify(pb.VerifyRequest(session_id="s-never", suite="calc")), "s-never")
    await expect(grpc.StatusCode.INVALID_ARGUMENT,
                 verifier.Verify(pb.VerifyRequest(session_id="s-right", final_answer=answer_of(task))),
                 "final_answer")
    await expect(grpc.StatusCode.INVALID_ARGUMENT,
                 verifier.Verify(pb.VerifyRequest(session_id="s-right", task_id=CALC[0].task_id)),
                 "not the session's")


# -- hidden tests -----------------------------------------------------------------------------


async def policy_sandbox(sandboxes, solution: str) -> str:
    """The policy's sandbox after its episode: its solution, and things it planted for the tests."""
    box = await sandboxes.CreateSandbox(sbx.CreateSandboxRequest())
    planted = [sbx.File(path="solution.py", content=solution.encode()),
               sbx.File(path="conftest.py", content=b"raise SystemExit('planted')"),
               sbx.File(path="test_hidden.py", content=b"print('RESULT passed=99 failed=0')")]
    await sandboxes.WriteFiles(sbx.WriteFilesRequest(sandbox_id=box.sandbox_id, files=planted))
    return box.sandbox_id


async def test_code_tasks_pass_and_fail_hidden_tests_run_outside_the_policy_sandbox(verifier, sandboxes):
    good = await policy_sandbox(sandboxes, code.reference_solution(CODE))
    passed = await verifier.Verify(pb.VerifyRequest(suite="code", task_id=CODE.task_id, sandbox_id=good))
    assert ((passed.passed, passed.reward, list(passed.reasons), passed.verifier_kind)
            == (True, 1.0, [], "unit_tests"))

    function = CODE.metadata["function"]
    bad = await policy_sandbox(sandboxes, f"def {function}(*args):\n    return None\n")
    failed = await verifier.Verify(pb.VerifyRequest(suite="code", task_id=CODE.task_id, sandbox_id=bad))
    assert not failed.passed and set(codes(failed)) == {"WRONG_ANSWER"}
    assert failed.reasons[0].details["test"].isdigit() and function not in repr(failed.reasons)

    for sandbox_id in (good, bad):  # the tests never entered the policy's workspace
        listed = await sandboxes.ListFiles(sbx.ListFilesRequest(sandbox_id=sandbox_id))
        assert sorted(listed.paths) == ["conftest.py", "solution.py", "test_hidden.py"]
        read = await sandboxes.ReadFiles(sbx.ReadFilesRequest(sandbox_id=sandbox_id,
                                                              paths=["test_hidden.py"]))
        assert read.files[0].content == b"print('RESULT passed=99 failed=0')"

    missing = await sandboxes.CreateSandbox(sbx.CreateSandboxRequest())
    nothing = await verifier.Verify(pb.VerifyRequest(suite="code", task_id=CODE.task_id,
                                                     sandbox_id=missing.sandbox_id))
    assert codes(nothing) == ["NO_ANSWER"] and nothing.reasons[0].details["missing"] == "solution.py"


async def test_hidden_tests_that_run_too_long_time_out(verifier, sandboxes):
    sleepy = await policy_sandbox(sandboxes, "import time\ntime.sleep(60)\n")
    verdict = await verifier.Verify(pb.VerifyRequest(suite="mini", task_id="mini-sleepy", sandbox_id=sleepy))
    assert (verdict.passed, codes(verdict)) == (False, ["TIMEOUT"])
    assert verdict.verify_s < 10
    offline = await verifier.Verify(pb.VerifyRequest(suite="mini", task_id="mini-sleepy",
                                                     files={"solution.py": b"def ready():\n    return 1\n",
                                                            "conftest.py": b"boom"}))
    assert offline.passed  # only the declared solution files reach the tests


# -- suites and bad input ---------------------------------------------------------------------


async def test_unknown_tasks_suites_and_sandboxes_are_not_found(verifier):
    await expect(grpc.StatusCode.NOT_FOUND,
                 verifier.Verify(pb.VerifyRequest(suite="calc", task_id="nope", final_answer="1")), "'nope'")
    await expect(grpc.StatusCode.NOT_FOUND,
                 verifier.Verify(pb.VerifyRequest(suite="chess", task_id=CALC[0].task_id, final_answer="1")),
                 "no suite 'chess'")
    await expect(grpc.StatusCode.NOT_FOUND,
                 verifier.Verify(pb.VerifyRequest(suite="calc", task_id=CALC[0].task_id,
                                                  sandbox_id="0123456789abcdef", final_answer="1")),
                 "0123456789abcdef")
    await expect(grpc.StatusCode.INVALID_ARGUMENT,
                 verifier.Verify(pb.VerifyRequest(final_answer="1")), "task_id")


async def test_new_suites_are_loaded_on_demand_and_a_bad_one_is_rejected_with_its_line(platform, verifier):
    extra = calc.generate_tasks("heldout", 1)[0]
    write_suite([extra], platform["suites"] / "calc-heldout.jsonl")
    found = await verifier.Verify(pb.VerifyRequest(suite="calc", task_id=extra.task_id,
                                                   final_answer=answer_of(extra)))
    assert found.passed

    line = dict(MINI, task_id="regex-1", suite="regex")
    bad_kind = dict(line, task_id="regex-2", verifier={"kind": "regex", "answer": "a+"})
    bad_file = platform["suites"] / "regex.jsonl"
    bad_file.write_text(json.dumps(line) + "\n" + json.dumps(bad_kind) + "\n")
    try:
        await expect(grpc.StatusCode.NOT_FOUND,
                     verifier.Verify(pb.VerifyRequest(suite="regex", task_id="regex-1", final_answer="a")),
                     "regex.jsonl:2: verifier.kind: unknown verifier kind 'regex'")
    finally:
        bad_file.unlink()  # forgotten at the next rescan
    await expect(grpc.StatusCode.NOT_FOUND, verifier.Verify(pb.VerifyRequest(suite="calc", task_id="gone",
                                                                              final_answer="1")))


# -- audit and metrics ------------------------------------------------------------------------


def labelled_set() -> list[dict]:
    a, b = CALC[0], CALC[1]
    return [
        {"episode_id": "tp", "suite": "calc", "task_id": a.task_id, "final_answer": answer_of(a),
         "human_passed": True},
        {"episode_id": "tn", "suite": "calc", "task_id": a.task_id, "final_answer": "7",
         "human_passed": False},
        # A human slip (a right answer labelled failed) and an answer the verifier is strict about:
        {"episode_id": "fp", "suite": "calc", "task_id": b.task_id, "final_answer": answer_of(b),
         "human_passed": False},
        {"episode_id": "fn", "suite": "calc", "task_id": b.task_id, "final_answer": f"{answer_of(b)} apples",
         "human_passed": True},
        {"episode_id": "transcript", "suite": "calc", "task_id": b.task_id, "human_passed": True,
         "transcript": f"<|im_start|>assistant\n<calc>{b.metadata['expression']}</calc><|im_end|>\n"
                       f"<|im_start|>tool\n{answer_of(b)}<|im_end|>\n"
                       f"<|im_start|>assistant\n<answer>{answer_of(b)}</answer><|im_end|>\n"},
        {"episode_id": "code", "suite": "code", "task_id": CODE.task_id, "human_passed": True,
         "files": {"solution.py": code.reference_solution(CODE)}},
    ]


async def test_audit_reports_rates_and_disagreements(verifier):
    labels = labelled_set()
    request = pb.AuditRequest(episodes=[pb.LabelledEpisode(
        suite=e["suite"], task_id=e["task_id"], final_answer=e.get("final_answer", ""),
        transcript=e.get("transcript", ""), files={k: v.encode() for k, v in e.get("files", {}).items()},
        human_passed=e["human_passed"], episode_id=e["episode_id"]) for e in labels])
    report = await verifier.Audit(request)
    assert (report.n, report.true_positives, report.false_positives, report.true_negatives,
            report.false_negatives) == (6, 3, 1, 1, 1)
    assert report.false_positive_rate == 0.5 and report.false_negative_rate == 0.25
    assert {(d.episode_id, d.verifier_passed) for d in report.disagreements} == {("fp", True), ("fn", False)}
    assert codes(next(d for d in report.disagreements if d.episode_id == "fn")) == ["WRONG_ANSWER"]


async def test_an_audit_larger_than_its_cap_or_empty_is_refused_with_details(verifier):
    task = CALC[0]
    episode = pb.LabelledEpisode(suite="calc", task_id=task.task_id, final_answer="1", human_passed=False)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await verifier.Audit(pb.AuditRequest(episodes=[episode] * 501))
    details = error_details(refused.value)
    assert details.code == grpc.StatusCode.INVALID_ARGUMENT and "max_audit_episodes" in details.message
    assert (details.metadata["count"], details.metadata["limit"]) == ("501", "500")
    assert "episodes" in details.field_violations
    await expect(grpc.StatusCode.INVALID_ARGUMENT, verifier.Audit(pb.AuditRequest()), "at least one")
    report = await verifier.Audit(pb.AuditRequest(episodes=[episode] * 3))
    assert [(s.suite, s.n, s.true_negatives) for s in report.suites] == [("calc", 3, 3)]


def test_the_audit_command_prints_the_same_report(platform, tmp_path):
    labels_file = tmp_path / "labels.jsonl"
    labels_file.write_text("\n".join(json.dumps(e) for e in labelled_set()) + "\n")
    audit_command = [str(BIN / "rlfleet-verifier-audit"), "--suite-dir", str(platform["suites"]), "--labels",
                     str(labels_file), "--sandbox-address", platform["manager"].address]
    as_json = subprocess.run([*audit_command, "--json"], capture_output=True, text=True, timeout=60)
    assert as_json.returncode == 0, as_json.stderr
    printed = json.loads(as_json.stdout)
    assert (printed["false_positive_rate"], printed["false_negative_rate"], printed["n"]) == (0.5, 0.25, 6)
    assert {d["episode_id"] for d in printed["disagreements"]} == {"fp", "fn"}
    text = subprocess.run(audit_command, capture_output=True, text=True, timeout=60)
    assert "false positive rate 0.500" in text.stdout and "false negative rate 0.250" in text.stdout, \
        text.stderr
    assert "  fn  " in text.stdout and "WRONG_ANSWER" in text.stdout


def test_the_audit_command_rejects_a_bad_labels_file_or_suite_with_one_line(platform, tmp_path):
    bad_suites = tmp_path / "bad-suites"
    bad_suites.mkdir()
    (bad_suites / "s.jsonl").write_text(json.dumps(dict(MINI, verifier={"kind": "regex"})) + "\n")
    labels_file = tmp_path / "labels.jsonl"
    labels_file.write_text(json.dumps({"task_id": "x", "human_passed": True, "verdict": "pass"}) + "\n")
    for suites, words in ((platform["suites"], "labels.jsonl:1: verdict: Extra inputs are not permitted"),
                          (bad_suites, "s.jsonl:1: verifier.kind: unknown verifier kind 'regex'"),
                          (tmp_path / "none", "is not a directory")):
        bad = subprocess.run([str(BIN / "rlfleet-verifier-audit"), "--suite-dir", str(suites), "--labels",
                              str(labels_file)], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and words in bad.stderr and len(bad.stderr.splitlines()) == 1, bad.stderr


async def test_metrics_count_verdicts_by_outcome_and_reason(platform, verifier):
    task = CALC[0]
    await verifier.Verify(pb.VerifyRequest(suite="calc", task_id=task.task_id, final_answer="-1"))
    await verifier.Verify(pb.VerifyRequest(suite="calc", task_id=task.task_id, final_answer=answer_of(task)))
    url = platform["verifier"].metrics_url
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    verdicts = [line for line in text.splitlines() if line.startswith("rlfleet_verifier_verdicts_total{")]
    assert any(all(label in line for label in ('kind="numeric"', 'passed="false"', 'reason="WRONG_ANSWER"'))
               for line in verdicts), verdicts
    assert any(line.startswith('rlfleet_verifier_verdicts_total{') and 'reason="none"' in line
               for line in verdicts)
    assert 'rlfleet_verifier_reasons_total{code="WRONG_ANSWER"' in text
    assert ("rlfleet_verifier_reward_bucket" in text
            and "rlfleet_verifier_verify_latency_seconds_count" in text)

