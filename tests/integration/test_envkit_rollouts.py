"""Episodes and rollout workers through the real services (`rlfleet up --detach`), with a scripted policy.

The engine behind the gateway is `rlfleet.envkit.testing`'s scripted engine: it stands in for the
policy (not for an rlfleet service), so every episode's path through the gateway, session server,
sandbox manager and verifier is real and its outcome is known in advance.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from tokenizers import Tokenizer

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.session.v1 import session_pb2
from rlfleet.common.chat import render_messages
from rlfleet.common.config import NatsConfig
from rlfleet.common.processes import ChildProcess
from rlfleet.common.streams import connect_nats, durable_name, publish, subject
from rlfleet.common.testing import client_env, unique_run_id
from rlfleet.envkit.groups import GroupRunner, session_id_key, session_id_of
from rlfleet.envkit.run_dir import RunDir
from rlfleet.envkit.sdk import AgentLoop, Clients, EpisodeSpec
from rlfleet.envkit.submit import publish_tasks, write_for_verifier
from rlfleet.envkit.suite_format import Task
from rlfleet.envkit.suites import calc, code
from rlfleet.envkit.task_queue import DEAD_LETTER_STREAM, REASON_HEADER, dead_letter_subject
from rlfleet.envkit.tasks import TASK_TYPE, task_message
from rlfleet.envkit.testing import LaunchedPlatform, build_tokenizer, start_scripted_engine
from rlfleet.envkit.worker import RolloutWorker
from rlfleet.envkit.worker_config import SamplingDefaults, WorkerConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
ACK_WAIT_S = 3.0  # every worker of the run shares the consumer, so every test uses the same settings


def sid(group_id: str, sample: int, delivery: int = 1) -> str:
    """The session id a worker of this run gives a sample (keyed: no other client can predict it)."""
    return session_id_of(group_id, sample, delivery, key=session_id_key())


@dataclass
class Rig:
    info: RunDir
    engine_url: str
    tokenizer: Tokenizer
    workdir: Path


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    root = tmp_path_factory.mktemp("envkit")
    tokenizer_dir = build_tokenizer(root / "tokenizer")
    engine, url = start_scripted_engine(tokenizer_dir, root)
    platform = LaunchedPlatform(root / "run", unique_run_id("ek"), tokenizer_dir, engine_url=url)
    try:
        platform.up()
        yield Rig(platform.info, url, Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")), root)
    finally:
        platform.down()
        engine.stop()


def worker_config(info: RunDir, **overrides) -> WorkerConfig:
    return WorkerConfig(run_id=info.run_id, nats={"url": info.nats_url, **info.nats_login("worker")},
                        session_address=info.session_address,
                        sandbox_address=info.sandbox_address, verifier_address=info.verifier_address,
                        concurrency=4, ack_wait_s=ACK_WAIT_S, max_deliver=4, nak_delay_s=0.2, **overrides)


def clients(info: RunDir) -> Clients:
    return Clients.connect(session=info.session_address, sandbox=info.sandbox_address,
                           verifier=info.verifier_address)


def custom_task(task_id: str, expression: str, script: str, max_turns: int = 3) -> Task:
    """A calc task whose user message carries the scripted policy's script."""
    base = calc.make_task(expression, 1)
    messages = (base.messages[0], base.messages[1].model_copy(
        update={"content": f"What is {expression}? [script: {script}]"}))
    return base.model_copy(update={"task_id": task_id, "messages": messages,
                                   "limits": base.limits.model_copy(update={"max_turns": max_turns})})


async def trajectories(info: RunDir, want, timeout_s: float = 15.0) -> list[common_pb2.Trajectory]:
    """The run's trajectories for which `want(t)` holds, waiting until `timeout_s` for more to arrive."""
    nc = await connect_nats(NatsConfig(url=info.nats_url, **info.nats_login("operator")), "itest-reader")
    found: dict[str, common_pb2.Trajectory] = {}
    try:
        sub = await nc.jetstream().subscribe(subject("TRAJECTORIES", info.run_id), ordered_consumer=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except Exception:  # nats' TimeoutError: nothing new yet
                if found:
                    break
                continue
            trajectory = common_pb2.Trajectory.FromString(msg.data)
            if want(trajectory):
                found[trajectory.trajectory_id] = trajectory
    finally:
        await nc.close()
    return list(found.values())


async def queue_is_empty(info: RunDir) -> bool:
    nc = await connect_nats(NatsConfig(url=info.nats_url, **info.nats_login("operator")), "itest-queue")
    try:
        consumer = await nc.jetstream().consumer_info("TASKS", durable_name("rollout-workers", info.run_id))
        return consumer.num_pending == 0 and consumer.num_ack_pending == 0
    finally:
        await nc.close()


def rlfleet_submit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "rlfleet-submit"), *args], capture_output=True, text=True, timeout=60)


async def set_engine_delay(url: str, delay_s: float) -> None:
    async with aiohttp.ClientSession() as http, http.post(url + "/script",
                                                          json={"delay_s": delay_s}) as reply:
        assert reply.status == 200


async def last_task_sequence(info: RunDir) -> int:
    nc = await connect_nats(NatsConfig(url=info.nats_url, **info.nats_login("operator")), "itest-seq")
    try:
        return (await nc.jetstream().stream_info("TASKS")).state.last_seq
    finally:
        await nc.close()


# -- the agent loop -----------------------------------------------------------------------------


async def test_a_calc_episode_runs_end_to_end_and_its_trajectory_carries_the_verdict(rig):
    task = calc.generate_tasks("train", 1, seed=101)[0]
    write_for_verifier([task], rig.info.suites_dir)
    message = task_message(task, rig.info.run_id)
    async with clients(rig.info) as services:
        summary = await AgentLoop(services).run(EpisodeSpec(task=message, session_id=f"e2e-{task.task_id}",
                                                            group_id=f"e2e-{task.task_id}"))
    assert (summary.end, summary.turns, summary.tool_calls, summary.invalid_calls) == ("answer", 2, 1, 0)
    assert summary.passed and summary.reward == 1.0 and summary.tool_wait_s > 0
    assert summary.final_answer == calc.tool_observation(task.metadata["expression"])

    [trajectory] = await trajectories(rig.info, lambda t: t.session_id == summary.session_id)
    assert trajectory.trajectory_id == summary.trajectory_id
    assert trajectory.status == common_pb2.TRAJECTORY_STATUS_COMPLETED
    assert trajectory.verdict.passed and trajectory.verdict.reward == 1.0
    assert trajectory.verdict.session_id == summary.session_id
    # The tokens are exactly the chat template's rendering of the conversation (observation tokenized once).
    conversation = [*task.chat_messages(),
                    {"role": "assistant", "content": f"<calc>{task.metadata['expression']}</calc>"},
                    {"role": "tool", "content": summary.final_answer},
                    {"role": "assistant", "content": f"<answer>{summary.final_answer}</answer>"}]
    rendered = render_messages(conversation, add_generation_prompt=False).removesuffix("\n")
    assert list(trajectory.token_ids) == rig.tokenizer.encode(rendered, add_special_tokens=False).ids
    kinds = [s.kind for s in trajectory.spans]
    assert kinds == [common_pb2.SPAN_KIND_PROMPT, common_pb2.SPAN_KIND_GENERATED,
                     common_pb2.SPAN_KIND_OBSERVATION, common_pb2.SPAN_KIND_GENERATED]


async def test_invalid_calls_and_a_wrong_answer_are_scored_by_the_verifier_not_the_client(rig):
    task = custom_task("itest-invalid", "2+3", "bad, unknown, calc, wrong")
    write_for_verifier([task], rig.info.suites_dir)
    async with clients(rig.info) as services:
        summary = await AgentLoop(services).run(
            EpisodeSpec(task=task_message(task, rig.info.run_id), session_id="itest-invalid-s0"))
    assert (summary.turns, summary.tool_calls, summary.invalid_calls) == (4, 1, 2)
    assert not summary.passed and summary.reward == pytest.approx(-0.1)  # 0 - 2 x 0.05
    assert "WRONG_ANSWER" in summary.reasons and summary.reasons.count("INVALID_TOOL_CALL") == 2


async def test_a_code_episode_writes_its_solution_in_the_sandbox_and_the_hidden_tests_pass(rig):
    task = code.generate_tasks("train", 1, seed=7)[0]
    messages = (task.messages[0], task.messages[1].model_copy(
        update={"content": task.messages[1].content + " [script: solve, run, done]"}))
    task = task.model_copy(update={"task_id": "itest-code", "messages": messages})
    write_for_verifier([task], rig.info.suites_dir)
    async with clients(rig.info) as services:
        summary = await AgentLoop(services).run(
            EpisodeSpec(task=task_message(task, rig.info.run_id), session_id="itest-code-s0"))
    assert (summary.end, summary.turns, summary.tool_calls, summary.invalid_calls) == ("answer", 3, 2, 0), \
        summary
    assert summary.passed and summary.reward == 1.0 and summary.error == ""


# -- the rollout worker -------------------------------------------------------------------------


async def test_a_worker_runs_each_task_as_a_group_of_g_and_acks_it_once_all_are_published(rig):
    args = ["calc", "--run-dir", str(rig.info.path), "--n", "2", "--group-size", "3", "--seed", "202"]
    submit = rlfleet_submit(*args)
    assert submit.returncode == 0, submit.stderr
    assert "published 2" in submit.stdout
    again = rlfleet_submit(*args)
    assert "published 0" in again.stdout and "2 already there" in again.stdout  # Nats-Msg-Id dedupe

    stats = await asyncio.wait_for(RolloutWorker(worker_config(rig.info)).run_until(2), 25)
    assert stats.tasks_acked == 2 and stats.episodes == {"passed": 6}
    groups = {s.group_id for s in stats.recent}
    published = await trajectories(rig.info, lambda t: t.group_id in groups)
    assert len(published) == 6
    for group in groups:
        members = [t for t in published if t.group_id == group]
        assert sorted(t.sample_index for t in members) == [0, 1, 2]
        assert {t.group_size for t in members} == {3} and all(t.verdict.passed for t in members)
        assert {t.session_id for t in members} == {sid(group, i) for i in range(3)}
    assert await queue_is_empty(rig.info)


async def test_a_worker_killed_mid_group_loses_no_task_another_worker_finishes_it(rig):
    task = calc.generate_tasks("train", 1, seed=303)[0]
    write_for_verifier([task], rig.info.suites_dir)
    await set_engine_delay(rig.engine_url, 2.0)
    worker_a, ready = worker_process(rig, "worker-a", "--concurrency", "3", "--metrics.enabled", "false")
    try:
        worker_a.wait_for_file(ready, 20)
        await publish_tasks([task], rig.info.run_id, rig.info.nats_url, group_size=3, epoch=303,
                            login=rig.info.nats_login("operator"))
        group_id = f"{task.task_id}-{await last_task_sequence(rig.info)}"
        await wait_until_open(rig.info, group_id, 3, worker_a)  # worker A is inside every episode
        worker_a.kill()  # SIGKILL: no cleanup, no nak; the task comes back after ack_wait
    finally:
        worker_a.kill()
        await set_engine_delay(rig.engine_url, 0.0)

    stats = await asyncio.wait_for(RolloutWorker(worker_config(rig.info)).run_until(1), 25)
    assert stats.tasks_acked == 1 and stats.episodes == {"passed": 3}
    published = await trajectories(rig.info, lambda t: t.group_id == group_id)
    kept = [t for t in published if t.status == common_pb2.TRAJECTORY_STATUS_COMPLETED]
    aborted = [t for t in published if t.status == common_pb2.TRAJECTORY_STATUS_ABORTED]
    assert sorted(t.sample_index for t in kept) == [0, 1, 2]  # each sample once, none lost
    assert {t.session_id for t in kept} == {sid(group_id, i, 2) for i in range(3)}
    # worker A's, for the audit
    assert {t.session_id for t in aborted} == {sid(group_id, i) for i in range(3)}
    assert await queue_is_empty(rig.info)


async def test_a_redelivered_group_skips_samples_an_earlier_delivery_closed_as_truncated(rig):
    """A sample that ran out of turns is closed TRUNCATED and published; a redelivery of its group
    (the chaos run's verifier kill stopped its other samples) skips it rather than failing every
    delivery until the task is dead-lettered."""
    task = custom_task(f"itest-trunc-{rig.info.run_id}", "2+3", "calc, calc, calc", max_turns=1)
    write_for_verifier([task], rig.info.suites_dir)
    message = task_message(task, rig.info.run_id)
    message.group_size = 2
    async with clients(rig.info) as services:
        runner = GroupRunner(AgentLoop(services), services.session, asyncio.Semaphore(2),
                             sampling=SamplingDefaults(), id_key=session_id_key())
        first = await runner.run(message, sequence=1, delivery=1)
        assert [e.status for e in first.episodes] == [common_pb2.TRAJECTORY_STATUS_TRUNCATED] * 2, first
        again = await runner.run(message, sequence=1, delivery=2)
    assert again.skipped == 2 and again.complete and not again.episodes, again


def worker_process(rig: Rig, name: str, *flags: str) -> tuple[ChildProcess, Path]:
    ready = rig.workdir / f"{name}.ready.json"
    child = ChildProcess([str(BIN / "rlfleet-worker"), "--run-id", rig.info.run_id,
                          "--nats.url", rig.info.nats_url, *login_flags(rig.info.nats_login("worker")),
                          "--session-address", rig.info.session_address,
                          "--sandbox-address", rig.info.sandbox_address,
                          "--verifier-address", rig.info.verifier_address, "--ack-wait-s", str(ACK_WAIT_S),
                          "--max-deliver", "4", "--log.format", "text", "--ready-file", str(ready), *flags],
                         rig.workdir / f"{name}.log", name=name).spawn()
    return child, ready


async def wait_until_open(info: RunDir, group_id: str, size: int, worker: ChildProcess) -> None:
    async with clients(info) as services:
        for _ in range(150):
            sessions = [await services.session.get(sid(group_id, i)) for i in range(size)]
            if all(s is not None and s.state == session_pb2.SESSION_STATE_OPEN for s in sessions):
                return
            await asyncio.sleep(0.1)
    pytest.fail(f"{worker.name} never opened the group's sessions: {worker.log()[-2000:]}")


async def test_a_worker_process_exports_metrics_and_on_sigterm_hands_its_unfinished_task_back_at_once(rig):
    fast, slow = calc.generate_tasks("train", 2, seed=606)
    write_for_verifier([fast, slow], rig.info.suites_dir)
    worker, ready = worker_process(rig, "worker-c", "--concurrency", "2", "--drain-timeout-s", "0",
                                   "--metrics.port", "0")
    try:
        port = worker.wait_for_file(ready, 20)["metrics_port"]
        await publish_tasks([fast], rig.info.run_id, rig.info.nats_url, group_size=2, epoch=606,
                            login=rig.info.nats_login("operator"))
        for _ in range(100):
            if await queue_is_empty(rig.info):
                break
            await asyncio.sleep(0.1)
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as reply:
            metrics = await reply.text()
        for name in ("rlfleet_worker_episodes_total", "rlfleet_worker_tool_wait_seconds",
                     "rlfleet_worker_episode_duration_seconds", "rlfleet_worker_episode_turns",
                     "rlfleet_worker_episode_reward", "rlfleet_worker_tasks_total"):
            assert name in metrics, name
        assert re.search(r'rlfleet_worker_episodes_total\{[^}]*outcome="passed"[^}]*\} 2\.0',
                         metrics), metrics

        await set_engine_delay(rig.engine_url, 2.0)
        await publish_tasks([slow], rig.info.run_id, rig.info.nats_url, group_size=2, epoch=606,
                            login=rig.info.nats_login("operator"))
        group_id = f"{slow.task_id}-{await last_task_sequence(rig.info)}"
        await wait_until_open(rig.info, group_id, 2, worker)
        stopped = time.monotonic()
        assert worker.stop(grace_s=15) == 0
        assert time.monotonic() - stopped < 10  # aborts its episodes instead of waiting for them
    finally:
        worker.kill()
        await set_engine_delay(rig.engine_url, 0.0)
    started = time.monotonic()
    stats = await asyncio.wait_for(RolloutWorker(worker_config(rig.info)).run_until(1), 25)
    assert stats.tasks_acked == 1 and stats.episodes == {"passed": 2}
    assert time.monotonic() - started < ACK_WAIT_S + 2  # handed back (nak), not left to time out
    published = await trajectories(rig.info, lambda t: t.group_id == group_id)
    kept = [t for t in published if t.status == common_pb2.TRAJECTORY_STATUS_COMPLETED]
    # the handed-back delivery
    assert {t.session_id for t in kept} == {sid(group_id, 0, 2), sid(group_id, 1, 2)}
    assert {t.session_id for t in published if t.status == common_pb2.TRAJECTORY_STATUS_ABORTED} == \
        {sid(group_id, 0), sid(group_id, 1)}  # the stopping worker aborted its own episodes
    assert await queue_is_empty(rig.info)


async def test_bad_task_messages_are_dead_lettered_with_their_reason_and_never_block_the_queue(rig):
    good = calc.generate_tasks("train", 1, seed=404)[0]
    write_for_verifier([good], rig.info.suites_dir)
    unknown = task_message(good, rig.info.run_id)
    unknown.suite, unknown.task_id = "chess", "itest-chess"
    nc = await connect_nats(NatsConfig(url=rig.info.nats_url, **rig.info.nats_login("operator")), "itest-bad")
    js = nc.jetstream()
    await publish(js, "TASKS", rig.info.run_id, b"\x08\xff\xff garbage", msg_type=TASK_TYPE)
    await publish(js, "TASKS", rig.info.run_id, unknown.SerializeToString(), msg_type=TASK_TYPE)
    await publish(js, "TASKS", rig.info.run_id, task_message(good, rig.info.run_id, 1).SerializeToString(),
                  msg_type=TASK_TYPE)
    stats = await asyncio.wait_for(RolloutWorker(worker_config(rig.info)).run_until(3), 25)
    assert stats.bad_tasks == {"undecodable": 1, "unknown_suite": 1} and stats.tasks_acked == 1
    dead = await js.subscribe(dead_letter_subject(rig.info.run_id), stream=DEAD_LETTER_STREAM,
                              ordered_consumer=True)
    reasons = []
    for _ in range(2):
        msg = await dead.next_msg(timeout=5)
        reasons.append(msg.headers[REASON_HEADER].split(":")[0])
    await nc.close()
    assert sorted(reasons) == ["undecodable", "unknown_suite"]
    assert await queue_is_empty(rig.info)


def test_the_custom_environment_example_runs_an_episode_with_the_generated_stubs_only(rig):
    task = calc.generate_tasks("train", 1, seed=505)[0]
    write_for_verifier([task], rig.info.suites_dir)
    client = ROOT / "examples" / "custom_env" / "client.py"
    assert "rlfleet.envkit" not in client.read_text() and "rlfleet.common" not in client.read_text()
    result = subprocess.run([sys.executable, str(client), "--session", rig.info.session_address,
                             "--sandbox", rig.info.sandbox_address, "--verifier", rig.info.verifier_address,
                             "--run-id", rig.info.run_id, "--task-id", task.task_id,
                             "--question", task.chat_messages()[-1]["content"]],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, **client_env(rig.info.run_id, "custom-env")})
    assert result.returncode == 0, result.stderr
    episode = json.loads(result.stdout)
    assert episode["passed"] and episode["reward"] == 1.0 and episode["tool_calls"] == 1
    published = asyncio.run(trajectories(rig.info, lambda t: t.session_id == episode["session_id"]))
    assert [t.trajectory_id for t in published] == [episode["trajectory_id"]]


NODE = shutil.which("node")


@pytest.mark.skipif(NODE is None, reason="node is not installed (scripts/install.sh installs the "
                                         "client's packages when it is)")
def test_the_node_client_runs_a_multi_turn_calc_episode_from_the_protos_alone(rig):
    node_env = ROOT / "examples" / "node_env"
    assert (node_env / "node_modules" / "@grpc" / "grpc-js").is_dir(), \
        "run scripts/install.sh (npm ci in examples/node_env)"
    task = calc.generate_tasks("train", 1, seed=606)[0]
    write_for_verifier([task], rig.info.suites_dir)
    result = subprocess.run([NODE, str(node_env / "client.js"), "--session", rig.info.session_address,
                             "--sandbox", rig.info.sandbox_address, "--verifier", rig.info.verifier_address,
                             "--run-id", rig.info.run_id, "--task-id", task.task_id,
                             "--question", task.chat_messages()[-1]["content"]],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, **client_env(rig.info.run_id, "node-env")})
    assert result.returncode == 0, result.stderr
    episode = json.loads(result.stdout)
    assert (episode["passed"] and episode["reward"] == 1.0 and episode["tool_calls"] == 1
            and episode["turns"] == 2)
    assert episode["token_ids_match"] and episode["model_type"] == "scripted"  # the rig's config.json says so
    (published,) = asyncio.run(trajectories(rig.info, lambda t: t.session_id == episode["session_id"]))
    assert published.trajectory_id == episode["trajectory_id"]
    assert list(published.token_ids) == episode["token_ids"]
    # The prompt, then generated turns and the observation the server framed, as ChatML renders them.
    text = rig.tokenizer.decode(episode["token_ids"], skip_special_tokens=False)
    assert "<|im_end|>\n<|im_start|>tool\n" in text and text.count("<|im_start|>assistant\n") == 2
    kinds = [s.kind for s in published.spans]
    assert kinds == [common_pb2.SPAN_KIND_PROMPT, common_pb2.SPAN_KIND_GENERATED,
                     common_pb2.SPAN_KIND_OBSERVATION, common_pb2.SPAN_KIND_GENERATED]


async def test_a_group_stopped_by_a_gateway_outage_runs_again_in_the_same_delivery(rig):
    """The gateway SIGKILLed while every sample of a group is generating: a platform failure, not the
    task's. The worker holds the delivery, waits for the restarted gateway (the launcher's
    supervision, on its recorded port) and runs the samples again as outage attempts: the task is
    acked on its first delivery, each sample published once. (The samples die inside OpenSession,
    whose first turn a retried open generates once the gateway is back: the worker here gives up
    retrying an open at once, so that the outage path runs.)"""
    import os
    import signal

    from rlfleet.cli.launcher import Platform, is_ours
    from rlfleet.common.processes import eventually

    task = calc.generate_tasks("train", 1, seed=404)[0]
    write_for_verifier([task], rig.info.suites_dir)
    await set_engine_delay(rig.engine_url, 2.0)
    # 4 episodes at once: the whole group runs
    worker = RolloutWorker(worker_config(rig.info, admission={"give_up_after_s": 0.3}))
    running = asyncio.create_task(worker.run_until(1))
    try:
        await publish_tasks([task], rig.info.run_id, rig.info.nats_url, group_size=3, epoch=404,
                            login=rig.info.nats_login("operator"))
        group_id = f"{task.task_id}-{await last_task_sequence(rig.info)}"
        async with clients(rig.info) as services:
            for _ in range(150):
                sessions = [await services.session.get(sid(group_id, i)) for i in range(3)]
                if all(s is not None and s.state == session_pb2.SESSION_STATE_OPEN for s in sessions):
                    break
                await asyncio.sleep(0.1)
        platform = Platform.attach(rig.info.path)
        gateway = platform.state.by_name("rollout-gateway")
        os.killpg(gateway.pid, signal.SIGKILL)
        await eventually(lambda: not is_ours(gateway), 10, message="the gateway is gone")
        await set_engine_delay(rig.engine_url, 0.0)
        await asyncio.sleep(1.0)  # the samples fail on the missing gateway meanwhile
        events = await asyncio.to_thread(platform.restart_dead)
        assert [e.split()[:2] for e in events] == [["rollout-gateway", "restarted"]], events
        stats = await asyncio.wait_for(running, 60)
    finally:
        await set_engine_delay(rig.engine_url, 0.0)
        if not running.done():
            running.cancel()
    assert stats.tasks_acked == 1 and stats.tasks_retried == 0 and stats.tasks_dead_lettered == 0
    assert stats.outage_reruns >= 1
    published = await trajectories(rig.info, lambda t: t.group_id == group_id)
    kept = [t for t in published if t.status == common_pb2.TRAJECTORY_STATUS_COMPLETED]
    assert sorted(t.sample_index for t in kept) == [0, 1, 2], "each sample published once"
    assert all("-r" not in t.session_id.removeprefix(group_id) for t in kept), "no second delivery"
    assert any("-o" in t.session_id for t in kept), [t.session_id for t in kept]
    assert await queue_is_empty(rig.info)


def login_flags(login: dict[str, str]) -> list[str]:
    return ["--nats.user", login["user"], "--nats.password-file", login["password_file"]] if login else []
