"""Tasks on the wire: a suite record's public view as a `rlfleet.common.v1.Task`, and back.

What goes on TASKS is only what the policy may see (`suite_format.public_view`): messages, tool
names, limits. Answers, hidden tests and metadata stay in the suite file the verifier reads.
Limits without a proto field travel in `Task.metadata` (`tool_timeout_s`), and so does the task's
starting workspace (`workspace`: its files as a JSON object, absent when it has none).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from google.protobuf.message import DecodeError

from rlfleet.api.common.v1 import common_pb2
from rlfleet.envkit.errors import EnvkitError
from rlfleet.envkit.suite_format import SCHEMA_VERSION, SPLITS, Task, public_view

TASK_TYPE = "rlfleet.common.v1.Task"
WORKSPACE_KEY = "workspace"


class BadTask(EnvkitError, ValueError):
    """A Task message a worker cannot run; `reason` is a short label for metrics."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        self.message = message
        super().__init__(f"{reason}: {message}")


def task_message(task: Task, run_id: str, group_size: int = 1,
                 temperature: float | None = None) -> common_pb2.Task:
    """The public view of a suite record as the message published on TASKS."""
    view = public_view(task)
    limits = view["limits"]
    sampling = common_pb2.SamplingParams(max_new_tokens=limits["max_new_tokens"])
    if temperature is not None:
        sampling.temperature = temperature
    metadata = {"tool_timeout_s": repr(float(limits["tool_timeout_s"]))}
    if view["workspace"]:
        metadata[WORKSPACE_KEY] = json.dumps(view["workspace"], sort_keys=True)
    return common_pb2.Task(
        schema_version=SCHEMA_VERSION, run_id=run_id, task_id=view["task_id"], suite=view["suite"],
        split=view["split"],
        messages=[common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in view["messages"]],
        tools=[tool["name"] for tool in view["tools"]], group_size=group_size, sampling=sampling,
        max_turns=limits["max_turns"], episode_timeout_s=limits["timeout_s"],
        metadata=metadata)


def decode_task(data: bytes, run_id: str, suites: Iterable[str]) -> common_pb2.Task:
    """A TASKS message as a Task, or `BadTask` saying why it cannot be run."""
    try:
        task = common_pb2.Task.FromString(data)
    except DecodeError as exc:
        raise BadTask("undecodable", f"not a serialized Task ({len(data)} bytes): {exc}") from None
    if task.schema_version != SCHEMA_VERSION:
        raise BadTask("schema_version",
                      f"schema_version {task.schema_version}, this worker reads {SCHEMA_VERSION}")
    if not task.task_id:
        raise BadTask("missing_task_id", "the task has no task_id")
    if task.run_id and task.run_id != run_id:
        raise BadTask("wrong_run", f"task {task.task_id} is for run {task.run_id!r}, not {run_id!r}")
    known = sorted(suites)
    if task.suite not in known:
        raise BadTask("unknown_suite", f"task {task.task_id}: no environment for suite {task.suite!r} "
                                       f"(known: {', '.join(known)})")
    if not any(m.role == "user" for m in task.messages):
        raise BadTask("no_prompt", f"task {task.task_id} has no user message")
    if task.split and task.split not in SPLITS:
        raise BadTask("bad_split", f"task {task.task_id}: unknown split {task.split!r}")
    if task.episode_timeout_s < 0 or task.sampling.max_new_tokens < 0:
        raise BadTask("bad_limits", f"task {task.task_id}: negative limits")
    return task


def workspace_of(task: common_pb2.Task) -> dict[str, str]:
    """The files a task's sandbox starts with (none when the task has no workspace); `BadTask` when
    the metadata is not a JSON object of path -> text."""
    text = task.metadata.get(WORKSPACE_KEY, "")
    if not text:
        return {}
    try:
        files = json.loads(text)
    except ValueError as exc:
        raise BadTask("bad_workspace", f"task {task.task_id}: workspace is not JSON: {exc}") from None
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                              for k, v in files.items()):
        raise BadTask("bad_workspace", f"task {task.task_id}: workspace must map paths to text")
    return files
