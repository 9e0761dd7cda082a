"""The agent loop's control flow, against in-memory stand-ins of the three services.

The real services are exercised end to end in tests/integration/test_envkit_*.py; here each branch of
the loop (limits, invalid calls, budgets, time limit, failures, cancellation) is pinned down quickly.
"""

import asyncio

import grpc
import pytest

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.sandbox.v1 import sandbox_pb2
from rlfleet.api.session.v1 import session_pb2
from rlfleet.common.rich_errors import ErrorDetails
from rlfleet.envkit.sdk import AgentLoop, Backoff, EpisodeSpec, Superseded, TemplateFraming
from rlfleet.envkit.sdk.environment import (
    CodeEnvironment,
    InProcessCalcEnvironment,
    UnknownSuite,
    environment_for,
    environments,
)
from rlfleet.envkit.sdk.errors import Backpressure, PeerUnavailable, RequestRejected, RpcNotFound
from rlfleet.envkit.suites import calc
from rlfleet.envkit.suites.calc_tool import evaluate_expression
from rlfleet.envkit.tasks import task_message

STOP = common_pb2.FINISH_REASON_STOP


class FakeSession:
    """Plays the policy's turns from a list; records the calls in order."""

    def __init__(self, turns, log, *, delay_s=0.0, budget_after=None, refuse_opens=0, observation_fills=None):
        self.observation_fills = observation_fills  # None, "exactly" (nothing generated) or "over" (refused)
        self.turns = list(turns)
        self.log = log
        self.delay_s = delay_s
        self.budget_after = budget_after
        self.refuse_opens = refuse_opens
        self.appended = []
        self.state = session_pb2.SESSION_STATE_OPEN
        self.generated = 0

    async def open(self, request):
        if self.refuse_opens:
            self.refuse_opens -= 1
            raise Backpressure("session", "OpenSession", grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
        self.log.append("open")
        return session_pb2.OpenSessionResponse(session_id=request.session_id,
                                               prompt_token_ids=[1, 7, 2, 8, 1, 9])

    async def generate(self, session_id, sampling=None, timeout_s=None, observation=None):
        if self.state == session_pb2.SESSION_STATE_ABORTED:
            raise RequestRejected("session", "Generate", grpc.StatusCode.FAILED_PRECONDITION, "aborted")
        if observation is not None:  # appended first, in the same call
            if self.observation_fills == "over":  # as the session server says it (its rich status)
                message = "the observation has 9 tokens but only 2 of the session's 64-token budget remain"
                code = grpc.StatusCode.INVALID_ARGUMENT
                error = ErrorDetails(code, message, "OBSERVATION_OVER_BUDGET", "rlfleet.session",
                                     metadata={"field": "text", "session_id": session_id},
                                     field_violations={"text": message})
                raise RequestRejected("session", "Generate", code, message, error)
            await self.append_text(session_id, observation)
            if self.observation_fills == "exactly":
                return session_pb2.GenerateResponse(budget_exhausted=True)
        await asyncio.sleep(self.delay_s)
        text = self.turns[min(self.generated, len(self.turns) - 1)]
        self.generated += 1
        self.log.append("generate")
        return session_pb2.GenerateResponse(text=text, token_ids=[40, 2], finish_reason=STOP,
                                            budget_exhausted=self.generated == self.budget_after)

    async def append_text(self, session_id, text):
        self.appended.append(text)
        self.log.append("append")
        return session_pb2.AppendObservationResponse()

    async def get(self, session_id):
        return session_pb2.Session(session_id=session_id, state=self.state)

    async def close(self, session_id, status=common_pb2.TRAJECTORY_STATUS_COMPLETED, metadata=None):
        self.log.append(("close", common_pb2.TrajectoryStatus.Name(status)))
        self.state = session_pb2.SESSION_STATE_CLOSED
        return session_pb2.CloseSessionResponse(trajectory_id="t-" + session_id)

    async def abort(self, session_id, reason):
        self.log.append(("abort", reason.split(":")[0]))
        self.state = session_pb2.SESSION_STATE_ABORTED
        return session_pb2.AbortSessionResponse(trajectory_id="a-" + session_id)


class FakeSandbox:
    """Runs the calculator in-process, as the sandbox would run its script."""

    def __init__(self, log, fail_exec=None, killed=False):
        self.log = log
        self.fail_exec = fail_exec
        self.killed = killed
        self.execs = []

    async def create(self, session_id="", labels=None, files=None, ttl_s=0.0):
        self.log.append("create")
        return sandbox_pb2.Sandbox(sandbox_id="sb-1")

    async def exec(self, sandbox_id, argv, stdin=b"", timeout_s=0.0, cwd=""):
        if self.fail_exec is not None:
            raise self.fail_exec
        self.execs.append(stdin)
        if self.killed:
            return sandbox_pb2.ExecResult(exit_code=-9, signal=9)
        out = evaluate_expression(stdin if isinstance(stdin, str) else stdin.decode())
        return sandbox_pb2.ExecResult(exit_code=1 if out.startswith("error:") else 0,
                                      stdout=(out + "\n").encode())

    async def destroy(self, sandbox_id):
        self.log.append("destroy")


class FakeVerifier:
    def __init__(self, log, fail=None):
        self.log = log
        self.fail = fail

    async def verify(self, session_id, suite, task_id, sandbox_id=""):
        self.log.append("verify")
        if self.fail is not None:
            raise self.fail
        return common_pb2.Verdict(session_id=session_id, reward=1.0, passed=True)


class FakeClients:
    def __init__(self, turns, **options):
        self.log = []
        session_options = ("delay_s", "budget_after", "refuse_opens", "observation_fills")
        self.session = FakeSession(turns, self.log,
                                   **{k: v for k, v in options.items() if k in session_options})
        self.sandbox = FakeSandbox(self.log, options.get("fail_exec"), options.get("killed", False))
        self.verifier = FakeVerifier(self.log, options.get("fail_verify"))


def spec(max_turns=3, timeout_s=30.0):
    task = task_message(calc.make_task("2+3", 1), run_id="r1", group_size=1)
    task.max_turns = max_turns
    task.episode_timeout_s = timeout_s
    return EpisodeSpec(task=task, session_id="calc-1-x-7-s0", group_id="calc-1-x-7")


def run(clients, episode_spec=None, **options):
    loop = AgentLoop(clients, admission=Backoff(0.001, 0.01, give_up_after_s=5.0), **options)
    return asyncio.run(loop.run(episode_spec or spec()))


def test_an_ideal_calc_episode_calls_the_tool_once_then_verifies_closes_and_destroys():
    clients = FakeClients(["<calc>2+3</calc>", "<answer>5</answer>"])
    summary = run(clients)
    assert (summary.end, summary.turns, summary.tool_calls, summary.invalid_calls) == ("answer", 2, 1, 0)
    assert summary.final_answer == "5" and summary.reward == 1.0 and summary.passed
    assert summary.status == common_pb2.TRAJECTORY_STATUS_COMPLETED
    assert summary.trajectory_id == "t-calc-1-x-7-s0"
    assert clients.session.appended == ["\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"]
    assert clients.log == ["open", "create", "generate", "append", "generate", "verify",
                           ("close", "TRAJECTORY_STATUS_COMPLETED"), "destroy"]


def test_invalid_calls_are_fed_back_as_error_observations_and_counted():
    clients = FakeClients(["<calc>1+2", "<python>1</python>", "<calc>1/0</calc>", "<answer>3</answer>"])
    summary = run(clients, spec(max_turns=3))
    assert summary.invalid_calls == 3 and summary.tool_calls == 1 and summary.end == "answer"
    observations = [text.split("\n")[2].removesuffix("<|im_end|>") for text in clients.session.appended]
    assert observations == ["error: malformed tool call: <calc> is not closed by </calc>",
                            "error: unknown tool 'python'; available: calc", "error: division by zero"]


def test_a_call_beyond_max_turns_is_not_run_and_ends_the_episode_truncated():
    clients = FakeClients(["<calc>1+1</calc>"])
    summary = run(clients, spec(max_turns=1))
    assert clients.sandbox.execs == ["1+1"]
    assert (summary.turns, summary.tool_calls, summary.invalid_calls, summary.end) == (2, 1, 1, "turn_limit")
    assert ("close", "TRAJECTORY_STATUS_TRUNCATED") in clients.log


def test_a_call_beyond_max_turns_gets_the_limit_error_while_turns_remain():
    clients = FakeClients(["<calc>1+1</calc>", "<calc>2+2</calc>", "<bad>", "<answer>4</answer>"])
    summary = run(clients, spec(max_turns=1))
    # turn 3 is malformed (does not count as a call); only max_turns + 1 = 2 turns are played anyway
    assert summary.turns == 2 and summary.end == "turn_limit"


def test_a_turn_without_a_tag_ends_the_episode_completed_without_an_answer():
    summary = run(FakeClients(["I think it is 5."]))
    assert summary.end == "no_action" and summary.final_answer is None
    assert summary.status == common_pb2.TRAJECTORY_STATUS_COMPLETED


def test_a_spent_token_budget_closes_the_session_truncated():
    clients = FakeClients(["<calc>2+3</calc>"], budget_after=1)
    summary = run(clients)
    assert summary.end == "budget" and summary.turns == 1
    assert ("close", "TRAJECTORY_STATUS_TRUNCATED") in clients.log


@pytest.mark.parametrize("fills", ["exactly", "over"])
def test_an_observation_that_fills_or_overflows_the_budget_closes_the_session_truncated(fills):
    clients = FakeClients(["<calc>2+3</calc>", "<answer>5</answer>"], observation_fills=fills)
    summary = run(clients)
    assert (summary.end, summary.turns, summary.tool_calls) == ("budget", 1, 1)
    assert clients.log[-3:] == ["verify", ("close", "TRAJECTORY_STATUS_TRUNCATED"), "destroy"]


def test_the_episode_time_limit_stops_the_turns_but_the_episode_is_still_verified_and_closed():
    clients = FakeClients(["<calc>2+3</calc>"], delay_s=0.2)
    summary = run(clients, spec(max_turns=10, timeout_s=0.5))
    assert summary.end == "timeout" and summary.outcome == "timeout"
    assert clients.log[-3:] == ["verify", ("close", "TRAJECTORY_STATUS_TRUNCATED"), "destroy"]


def test_an_unreachable_sandbox_aborts_the_session_so_a_redelivery_runs_it_again():
    unreachable = PeerUnavailable("sandbox", "Exec", grpc.StatusCode.UNAVAILABLE, "connection refused")
    clients = FakeClients(["<calc>2+3</calc>"], fail_exec=unreachable)
    summary = run(clients)
    assert summary.status == common_pb2.TRAJECTORY_STATUS_ABORTED and summary.outcome == "error"
    assert "connection refused" in summary.error and clients.log[-1] == "destroy"


def test_a_sandbox_its_restarted_manager_does_not_know_is_a_platform_failure_run_again_not_failed():
    # A restarted sandbox manager knows no sandbox of its predecessor's: the sample is the platform's
    # loss, aborted for a re-run, where NOT_FOUND on its own had closed it FAILED (never trained on).
    lost = RpcNotFound("sandbox", "Exec", grpc.StatusCode.NOT_FOUND, "sandbox 'sb-1' not found (unknown)")
    clients = FakeClients(["<calc>2+3</calc>"], fail_exec=lost)
    summary = run(clients)
    assert summary.status == common_pb2.TRAJECTORY_STATUS_ABORTED and summary.platform_failure
    assert ("close", "TRAJECTORY_STATUS_FAILED") not in clients.log and clients.log[-1] == "destroy"
    # the same code from another service is still a lasting failure of the environment
    missing = RpcNotFound("verifier", "Verify", grpc.StatusCode.NOT_FOUND, "no such task")
    clients = FakeClients(["<answer>5</answer>"], fail_verify=missing)
    assert run(clients).status == common_pb2.TRAJECTORY_STATUS_FAILED


def test_a_calculator_killed_without_a_violation_is_an_environment_failure_not_an_invalid_call():
    clients = FakeClients(["<calc>2+3</calc>"], killed=True)
    summary = run(clients)
    assert summary.invalid_calls == 0 and summary.outcome == "error" and "signal 9" in summary.error
    assert summary.status == common_pb2.TRAJECTORY_STATUS_ABORTED  # so that a redelivery runs it again


def test_a_rejected_request_closes_the_session_failed_so_it_is_never_trained_on():
    rejected = RequestRejected("verifier", "Verify", grpc.StatusCode.INVALID_ARGUMENT, "bad task")
    clients = FakeClients(["<answer>5</answer>"], fail_verify=rejected)
    summary = run(clients)
    assert summary.status == common_pb2.TRAJECTORY_STATUS_FAILED
    assert ("close", "TRAJECTORY_STATUS_FAILED") in clients.log and clients.log[-1] == "destroy"


def test_admission_refusals_are_retried_until_the_session_opens():
    retries = []
    clients = FakeClients(["<answer>5</answer>"], refuse_opens=2)
    from rlfleet.envkit.sdk import EpisodeHooks

    summary = run(clients, hooks=EpisodeHooks(on_admission_retry=retries.append))
    assert len(retries) == 2 and summary.end == "answer"


def test_cancelling_an_episode_aborts_its_session_and_destroys_its_sandbox():
    clients = FakeClients(["<calc>2+3</calc>"], delay_s=5.0)

    async def main():
        loop = AgentLoop(clients)
        task = asyncio.create_task(loop.run(spec()))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert clients.log[-2:] == [("abort", "cancelled"), "destroy"]


def test_a_session_aborted_by_another_worker_raises_superseded_and_still_destroys_the_sandbox():
    clients = FakeClients(["<calc>2+3</calc>"])
    clients.session.state = session_pb2.SESSION_STATE_ABORTED
    with pytest.raises(Superseded):
        run(clients)
    assert clients.log[-1] == "destroy" and not any(isinstance(e, tuple) for e in clients.log)


def test_a_task_offering_a_tool_its_environment_cannot_run_fails_before_any_session():
    episode = spec()
    episode.task.tools.append("browser")
    clients = FakeClients(["<answer>5</answer>"])
    summary = run(clients, episode)
    assert summary.outcome == "error" and "browser" in summary.error and "open" not in clients.log


# -- tool runtimes ---------------------------------------------------------------------------------

def test_in_process_calc_runs_no_sandbox_and_feeds_back_what_the_sandboxed_script_prints():
    turns = ["<calc>2+3</calc>", "<calc>1/0</calc>", "<answer>5</answer>"]
    sandboxed, in_process = FakeClients(turns), FakeClients(turns)
    run(sandboxed)
    summary = run(in_process, environments=environments("in_process"))
    assert in_process.session.appended == sandboxed.session.appended  # the policy sees the same episode
    assert (summary.tool_calls, summary.invalid_calls, summary.sandbox_id) == (2, 1, "")
    assert in_process.log == ["open", "generate", "append", "generate", "append", "generate", "verify",
                              ("close", "TRAJECTORY_STATUS_COMPLETED")]
    assert in_process.sandbox.execs == []


def test_a_worker_preferring_in_process_tools_still_sandboxes_a_suite_that_runs_model_written_code():
    prefer = environments("in_process")
    assert isinstance(prefer("calc"), InProcessCalcEnvironment)
    assert isinstance(prefer("code"), CodeEnvironment) and prefer("code").needs_sandbox
    with pytest.raises(UnknownSuite, match="'code' environment has no in_process tool runtime"):
        environment_for("code", "in_process")
    with pytest.raises(ValueError, match="unknown tool runtime 'docker'"):
        environments("docker")
    with pytest.raises(UnknownSuite, match="no environment for suite 'chess'"):
        prefer("chess")


@pytest.mark.parametrize("fmt, call", [
    ("hermes", '<tool_call>\n{"name": "calc", "arguments": {"expression": "2+3"}}\n</tool_call><|im_end|>'),
    ("llama3_json", '{"name": "calc", "parameters": {"expression": "2+3"}}<|eot_id|>'),
    ("mistral", '[TOOL_CALLS] [{"name": "calc", "arguments": {"expression": "2+3"}}]</s>'),
])
def test_another_family_s_tool_call_format_runs_the_tool_and_sends_the_result_as_a_message_to_frame(
    fmt, call
):
    from rlfleet.envkit.sdk import framing_for

    clients = FakeClients([call, "<answer>5</answer>"])
    summary = run(clients, tool_call_format=fmt, framing=framing_for("template"))
    assert (summary.end, summary.tool_calls, summary.invalid_calls,
            summary.final_answer) == ("answer", 1, 0, "5")
    (appended,) = clients.session.appended
    assert [(m.role, m.content) for m in appended.messages.messages] == [("tool", "5")]
    assert appended.add_generation_prompt


def test_a_malformed_call_in_another_format_is_an_invalid_call_fed_back():
    clients = FakeClients(['<tool_call>{"name": "calc", "arguments": 2+3}</tool_call>', "<answer>5</answer>"])
    summary = run(clients, tool_call_format="hermes", framing=TemplateFraming)
    assert summary.invalid_calls == 1 and summary.tool_calls == 0
    (appended,) = clients.session.appended
    assert appended.messages.messages[0].content.startswith("error: malformed tool call: not JSON")
