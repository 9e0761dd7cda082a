"""A custom environment in ~150 lines that talks to rlfleet through the generated gRPC stubs only.

It runs one `calc` episode end to end: a fresh sandbox, a session, the turn loop (generate, parse,
run the tool in the sandbox, append the observation), the verifier's verdict, the close that publishes
the trajectory, and the sandbox's destruction. Nothing here imports the rlfleet SDK: any language
with gRPC can do the same from proto/rlfleet/*/v1/*.proto.

    export RLFLEET_TOKEN=$(rlfleet token issue my-env --run-dir runs/local)
    export RLFLEET_CA_FILE=runs/local/secrets/ca.pem
    python examples/custom_env/client.py --session 127.0.0.1:7002 --sandbox 127.0.0.1:7003 \\
        --verifier 127.0.0.1:7004 --run-id local --task-id calc-1-4e1d2a187ed6 --question "What is 2+3?"

Every call goes over TLS (the run's CA certificate) with the token as `authorization: Bearer`,
gRPC's standard access-token credentials in any language (`--token` / `--ca-file` or the
environment). The sessions and sandboxes it creates are its own: no other client sees them.

The task must be known to the verifier (a suite file in its suites directory, e.g. written by
`rlfleet-submit calc --run-dir runs/local --n 10`): the client names the task, it never gives a reward.
Prints the episode as one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import uuid

import grpc

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from rlfleet.api.session.v1 import session_pb2, session_pb2_grpc
from rlfleet.api.verifier.v1 import verifier_pb2, verifier_pb2_grpc

SYSTEM = ("You are a calculator agent. Call the calculator as <calc>expression</calc>; "
          "it replies with the result. Then reply <answer>result</answer>.")
# The tool runs inside the sandbox, never in this process: integers, + - * / // % and parentheses.
CALCULATOR = r"""
import ast, operator, sys
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}
def ev(node):
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        return OPS[type(node.op)](ev(node.left), ev(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
        return OPS[type(node.op)](ev(node.operand))
    raise ValueError("unsupported expression")
try:
    value = ev(ast.parse(sys.stdin.read().strip(), mode="eval").body)
    print(int(value) if value == int(value) else value)
except Exception as exc:
    print(f"error: {exc}")
    sys.exit(1)
"""
TAG = re.compile(r"<(?P<tool>[a-z_]+)>(?P<args>.*?)</(?P=tool)>", re.DOTALL)
IM_START, IM_END = "<|im_start|>", "<|im_end|>"


def framed(observation: str, reply: session_pb2.GenerateResponse) -> str:
    """The observation as the ChatML template renders it after the assistant's turn. A turn that ended
    on its own (STOP) already holds the model's <|im_end|>; one cut at max_new_tokens is closed here."""
    closed = reply.finish_reason == common_pb2.FINISH_REASON_STOP
    return (("\n" if closed else IM_END + "\n")
            + f"{IM_START}tool\n{observation}{IM_END}\n{IM_START}assistant\n")


def credentials(args: argparse.Namespace) -> grpc.ChannelCredentials:
    """TLS with the run's CA, and the token on every call."""
    if not args.token or not args.ca_file:
        raise SystemExit("client.py: needs --token and --ca-file (or RLFLEET_TOKEN and RLFLEET_CA_FILE)")
    with open(args.ca_file, "rb") as ca:
        tls = grpc.ssl_channel_credentials(ca.read())
    return grpc.composite_channel_credentials(tls, grpc.access_token_call_credentials(args.token))


async def episode(args: argparse.Namespace) -> dict:
    session_id = f"custom-{uuid.uuid4().hex}"
    creds = credentials(args)
    async with grpc.aio.secure_channel(args.session, creds) as s_ch, \
            grpc.aio.secure_channel(args.sandbox, creds) as b_ch, \
            grpc.aio.secure_channel(args.verifier, creds) as v_ch:
        sessions = session_pb2_grpc.SessionServiceStub(s_ch)
        sandboxes = sandbox_pb2_grpc.SandboxServiceStub(b_ch)
        verifier = verifier_pb2_grpc.VerifierServiceStub(v_ch)

        box = await sandboxes.CreateSandbox(sandbox_pb2.CreateSandboxRequest(session_id=session_id),
                                            timeout=30)
        opened = False
        try:
            messages = [common_pb2.ChatMessage(role="system", content=SYSTEM),
                        common_pb2.ChatMessage(role="user", content=args.question)]
            await sessions.OpenSession(session_pb2.OpenSessionRequest(
                session_id=session_id, run_id=args.run_id, task_id=args.task_id, group_id=session_id,
                group_size=1, suite=args.suite, split="train",
                messages=common_pb2.ChatMessages(messages=messages),
                sampling=common_pb2.SamplingParams(max_new_tokens=48,
                                                   temperature=args.temperature)), timeout=60)
            opened = True
            turns = tool_calls = 0
            for _ in range(args.max_turns + 1):
                reply = await sessions.Generate(session_pb2.GenerateRequest(session_id=session_id),
                                                timeout=120)
                turns += 1
                call = TAG.search(reply.text)
                if call is None or call["tool"] == "answer" or reply.budget_exhausted:
                    break
                if call["tool"] == "calc":
                    result = await sandboxes.Exec(sandbox_pb2.ExecRequest(
                        sandbox_id=box.sandbox_id, argv=["python3", "-I", "-S", "-c", CALCULATOR],
                        stdin=call["args"].encode(), timeout_seconds=5), timeout=30)
                    observation = (result.stdout.decode(errors="replace").strip()
                                   or f"error: exit {result.exit_code}")
                    tool_calls += 1
                else:
                    observation = f"error: unknown tool {call['tool']!r}; available: calc"
                await sessions.AppendObservation(session_pb2.AppendObservationRequest(
                    session_id=session_id, text=framed(observation, reply)), timeout=30)
            verdict = await verifier.Verify(verifier_pb2.VerifyRequest(
                session_id=session_id, suite=args.suite, task_id=args.task_id,
                sandbox_id=box.sandbox_id), timeout=120)
            closed = await sessions.CloseSession(session_pb2.CloseSessionRequest(
                session_id=session_id, status=common_pb2.TRAJECTORY_STATUS_COMPLETED), timeout=30)
            opened = False
            return {"session_id": session_id, "trajectory_id": closed.trajectory_id, "turns": turns,
                    "tool_calls": tool_calls, "reward": verdict.reward, "passed": verdict.passed,
                    "reasons": [common_pb2.ReasonCode.Name(r.code) for r in verdict.reasons]}
        finally:
            if opened:  # something failed mid-episode: never leave the session open
                await sessions.AbortSession(
                    session_pb2.AbortSessionRequest(session_id=session_id, reason="client error"), timeout=30)
            await sandboxes.DestroySandbox(sandbox_pb2.DestroySandboxRequest(sandbox_id=box.sandbox_id),
                                           timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--session", required=True, help="host:port of the session server")
    parser.add_argument("--sandbox", required=True, help="host:port of the sandbox manager")
    parser.add_argument("--verifier", required=True, help="host:port of the verifier")
    parser.add_argument("--run-id", required=True, help="the platform's run")
    parser.add_argument("--suite", default="calc")
    parser.add_argument("--task-id", required=True, help="a task the verifier knows")
    parser.add_argument("--question", required=True, help="the task's user message, e.g. 'What is 2+3?'")
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--token", default=os.environ.get("RLFLEET_TOKEN", ""),
                        help="the client's token (`rlfleet token issue`); default $RLFLEET_TOKEN")
    parser.add_argument("--ca-file", default=os.environ.get("RLFLEET_CA_FILE", ""),
                        help="the run's CA certificate (<run_dir>/secrets/ca.pem); default $RLFLEET_CA_FILE")
    print(json.dumps(asyncio.run(episode(parser.parse_args()))))


if __name__ == "__main__":
    main()
