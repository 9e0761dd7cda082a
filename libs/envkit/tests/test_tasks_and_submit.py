"""Tasks on the wire, the submit command's loading and writing, and the worker's naming rules."""

import json

import pytest

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.sandbox.v1 import sandbox_pb2
from rlfleet.common.config import ConfigError, load_config
from rlfleet.envkit.groups import GroupRunner, group_id_of, session_id_of
from rlfleet.envkit.run_dir import RunDir, RunDirError
from rlfleet.envkit.sdk import exec_observation
from rlfleet.envkit.submit import SubmitError, check_suites, load_tasks, main, write_for_verifier
from rlfleet.envkit.suite_format import load_suite, write_suite
from rlfleet.envkit.suites import calc, code
from rlfleet.envkit.tasks import BadTask, decode_task, task_message
from rlfleet.envkit.testing import scripted_turn
from rlfleet.envkit.worker_config import SamplingDefaults, WorkerConfig

SUITES = ["calc", "code"]


def test_a_task_message_carries_only_the_public_view():
    task = calc.make_task("37*48+5", 2)
    message = task_message(task, run_id="r1", group_size=4)
    data = message.SerializeToString()
    assert b"1781" not in data  # the answer stays with the verifier
    assert message.tools == ["calc"] and message.group_size == 4 and message.max_turns == 3
    assert message.sampling.max_new_tokens == 48 and message.episode_timeout_s == 30.0
    assert message.metadata["tool_timeout_s"] == "5.0" and not message.sampling.HasField("temperature")
    assert [m.role for m in message.messages] == ["system", "user"]
    assert decode_task(data, "r1", SUITES) == message


@pytest.mark.parametrize(("data", "reason"), [
    (b"\xff\xff\xff not a protobuf", "undecodable"),
    (common_pb2.Task(schema_version=2, task_id="t").SerializeToString(), "schema_version"),
    (common_pb2.Task(schema_version=1).SerializeToString(), "missing_task_id"),
    (common_pb2.Task(schema_version=1, task_id="t", suite="chess").SerializeToString(), "unknown_suite"),
    (common_pb2.Task(schema_version=1, task_id="t", suite="calc",
                     run_id="other").SerializeToString(), "wrong_run"),
    (common_pb2.Task(schema_version=1, task_id="t", suite="calc").SerializeToString(), "no_prompt"),
])
def test_a_task_message_a_worker_cannot_run_is_a_bad_task_with_its_reason(data, reason):
    with pytest.raises(BadTask) as caught:
        decode_task(data, "r1", SUITES)
    assert caught.value.reason == reason


def test_group_and_session_ids_are_a_function_of_the_stream_sequence_and_the_delivery():
    assert group_id_of("calc-1-ab", 17) == "calc-1-ab-17"
    assert session_id_of("calc-1-ab-17", 2) == "calc-1-ab-17-s2"
    assert session_id_of("calc-1-ab-17", 2, delivery=3) == "calc-1-ab-17-s2-r3"
    # A re-run inside the same delivery after a service outage gets an ID no other attempt used.
    assert session_id_of("calc-1-ab-17", 2, outage=1) == "calc-1-ab-17-s2-o1"
    assert session_id_of("calc-1-ab-17", 2, delivery=3, outage=2) == "calc-1-ab-17-s2-r3-o2"


def test_each_sample_of_a_group_gets_its_own_seed_and_unset_sampling_comes_from_the_worker():
    runner = GroupRunner(None, None, None,
                         sampling=SamplingDefaults(temperature=0.7, seed=5, max_new_tokens=99))
    task = common_pb2.Task(sampling=common_pb2.SamplingParams(max_new_tokens=48, top_p=0.9))
    first, second = (runner.sampling_for(task, f"g-s{i}", i) for i in range(2))
    assert first.max_new_tokens == 48 and first.top_p == pytest.approx(0.9)
    assert first.temperature == pytest.approx(0.7) and first.seed != second.seed
    seeded = common_pb2.Task(sampling=common_pb2.SamplingParams(max_new_tokens=8, seed=10))
    assert [runner.sampling_for(seeded, "x", i).seed for i in range(3)] == [10, 11, 12]


def test_built_in_suites_are_generated_deterministically_by_name():
    assert [t.task_id for t in load_tasks("calc", "train", 5, seed=3)] == \
        [t.task_id for t in calc.generate_tasks("train", 5, seed=3)]
    assert len(load_tasks("code", "heldout", 2)) == 2


def test_a_malformed_suite_line_is_an_error_naming_its_line(tmp_path):
    path = tmp_path / "mine.jsonl"
    good = json.dumps({"task_id": "t1", "suite": "calc", "split": "train", "prompt": "What is 1+1?",
                       "verifier": {"kind": "numeric", "answer": "2"}, "tools": [{"name": "calc"}]})
    path.write_text(good + "\n\n" + '{"task_id": "t2", "suite": calc}\n')
    with pytest.raises(SubmitError, match=r"mine.jsonl:3: invalid JSON"):
        load_tasks(str(path))


def test_an_unknown_source_or_suite_is_refused_before_anything_is_published(tmp_path, capsys):
    with pytest.raises(SubmitError, match="neither a built-in suite"):
        load_tasks("chess")
    task = calc.make_task("1+2", 1).model_copy(update={"suite": "chess"})
    with pytest.raises(SubmitError, match="no environment for suite"):
        check_suites([task], SUITES)
    with pytest.raises(SystemExit) as exited:
        main(["calc", "--n", "2", "--run-id", "r", "--suites-dir", str(tmp_path)])  # no --nats-url
    assert exited.value.code == 2 and "--nats-url" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_suites_are_merged_per_suite_for_the_verifier_and_a_changed_task_is_refused(tmp_path):
    first = calc.generate_tasks("train", 3)
    more = calc.generate_tasks("train", 5)
    assert write_for_verifier(first, tmp_path)[1] == 3
    files, written = write_for_verifier(more + code.generate_tasks("train", 1), tmp_path)
    assert written == 3 and sorted(f.name for f in files) == ["calc.jsonl", "code.jsonl"]
    assert [t.task_id for t in load_suite(tmp_path / "calc.jsonl")] == [t.task_id for t in more]
    changed = first[0].model_copy(update={"metadata": {"expression": "different"}})
    with pytest.raises(SubmitError, match="different content"):
        write_for_verifier([changed], tmp_path)


def test_tasks_another_suite_file_already_defines_are_not_repeated(tmp_path):
    # The verifier rejects a whole file that repeats a task of another file.
    write_suite(calc.generate_tasks("train", 4), tmp_path / "calc-train.jsonl")
    _, written = write_for_verifier(calc.generate_tasks("train", 6), tmp_path)
    assert written == 2 and len(load_suite(tmp_path / "calc.jsonl")) == 2


def test_a_run_dir_names_the_services_and_the_verifiers_suites_dir(tmp_path):
    processes = [{"name": "nats", "url": "nats://127.0.0.1:1", "address": "127.0.0.1:1"},
                 {"name": "session-server", "address": "127.0.0.1:2"},
                 {"name": "verifier", "address": "127.0.0.1:3",
                  "cmdline": ["rlfleet-verifier", "--suites-dir", "/s"]}]
    (tmp_path / "platform.json").write_text(json.dumps({"run_id": "r9", "processes": processes}))
    run = RunDir.load(tmp_path)
    assert (run.run_id, run.nats_url, run.session_address, run.suites_dir.as_posix()) == \
        ("r9", "nats://127.0.0.1:1", "127.0.0.1:2", "/s")
    with pytest.raises(RunDirError, match="rlfleet up"):
        RunDir.load(tmp_path / "nowhere")


def test_worker_config_reads_flags_and_refuses_unknown_keys():
    config = load_config(WorkerConfig,
                         ["--run-id", "r1", "--concurrency", "3", "--sampling.temperature", "0"], prog="w",
                         environ={})
    assert config.concurrency == 3 and config.sampling.temperature == 0
    assert config.effective_ack_wait_s == 15.0 and config.heartbeat_s == 3.75
    unset = load_config(WorkerConfig, ["--run-id", "r1", "--ack-wait-s", "0"], prog="w", environ={})
    assert unset.effective_ack_wait_s == unset.episode_timeout_s + 30
    with pytest.raises(ConfigError, match="unknown key 'concurency'"):
        load_config(WorkerConfig, ["--set", "concurency=3"], prog="w", environ={})


def test_an_exec_observation_is_stdout_or_one_error_line_per_failure():
    ok = exec_observation(sandbox_pb2.ExecResult(exit_code=0, stdout=b"1781\n"), 5)
    assert (ok.observation, ok.ok) == ("1781", True)
    rejected = exec_observation(sandbox_pb2.ExecResult(exit_code=1, stdout=b"error: division by zero\n"), 5)
    assert (rejected.observation, rejected.ok) == ("error: division by zero", False)
    timeout = sandbox_pb2.Violation(kind=sandbox_pb2.VIOLATION_KIND_TIMEOUT, message="wall")
    slow = exec_observation(sandbox_pb2.ExecResult(exit_code=-9, violations=[timeout]), 5)
    assert slow.observation == "error: the tool ran past its time limit of 5 s"
    assert slow.violations == ("timeout",)
    crash = exec_observation(sandbox_pb2.ExecResult(exit_code=1, stderr=b"Traceback\nNameError: x\n"), 5)
    assert crash.observation == "NameError: x"
    long = exec_observation(sandbox_pb2.ExecResult(exit_code=0, stdout=b"x" * 5000), 5)
    assert len(long.observation) < 2100 and long.observation.endswith("(3000 more characters)")


def test_the_scripted_policy_plays_its_tasks_script_turn_by_turn():
    prompt = "<|im_start|>user\nWhat is 2+3? [script: bad, calc, answer]<|im_end|>\n<|im_start|>assistant\n"
    assert scripted_turn(prompt) == "<calc>2+3"
    second = prompt + "<calc>2+3<|im_end|>\n<|im_start|>tool\nerror<|im_end|>\n<|im_start|>assistant\n"
    assert scripted_turn(second) == "<calc>2+3</calc>"
    third = second + "<calc>2+3</calc><|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    assert scripted_turn(third) == "<answer>5</answer>"


def test_keyed_session_ids_cannot_be_predicted_without_the_key():
    ours, theirs = session_id_of("calc-1-ab-17", 2, key=b"k1"), session_id_of("calc-1-ab-17", 2, key=b"k2")
    assert ours != theirs and ours != "calc-1-ab-17-s2" and ours.startswith("calc-1-ab-17-")
    assert ours == session_id_of("calc-1-ab-17", 2, key=b"k1")  # every worker with the key: the same id
    assert session_id_of("calc-1-ab-17", 2, delivery=3, key=b"k1").endswith("-s2-r3")
