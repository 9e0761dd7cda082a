"""What an environment is to the agent loop: the tools it runs, and how it runs one in a sandbox.

Writing your own environment means writing one class:

    class MyEnvironment:
        suite = "my-suite"
        tools = ("search",)

        async def setup(self, sandbox: SandboxHandle, task) -> None:
            await sandbox.write_files({"data.txt": "..."})

        async def run_tool(self, sandbox: SandboxHandle, call: ToolCall) -> ToolResult:
            result = await sandbox.exec(["grep", "-n", call.args, "data.txt"])
            return exec_observation(result, sandbox.tool_timeout_s)

and registering it with :func:`register_environment`. The agent loop does everything else: the
session, turns, parsing, limits, verification and cleanup. The tools run only inside the
episode's sandbox; the verifier later reads that sandbox's execs and files itself.

Tool runtimes: `sandbox` (the default) gives every episode a fresh sandbox. A tool that is a pure
function of its arguments, implemented by trusted code (no model-written code runs), may also be
offered `in_process`: the environment sets `needs_sandbox = False` and the agent loop then creates
no sandbox at all and calls `run_tool(None, call)` in the rollout worker. On a CPU-bound fleet this
removes a sandbox per episode and a process per call.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol, get_args, runtime_checkable

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.sandbox.v1 import sandbox_pb2
from rlfleet.envkit.actions import ToolCall
from rlfleet.envkit.errors import EnvkitError
from rlfleet.envkit.sdk.clients import SandboxClient
from rlfleet.envkit.sdk.errors import RequestRejected, SandboxFailure
from rlfleet.envkit.suites import calc, code, repo
from rlfleet.envkit.tasks import BadTask, workspace_of

MAX_OBSERVATION_CHARS = 2000
ToolRuntime = Literal["sandbox", "in_process"]
TOOL_RUNTIMES: tuple[str, ...] = get_args(ToolRuntime)


@dataclass(frozen=True)
class ToolResult:
    """One tool call's outcome: the observation the policy sees, and what the loop counts."""

    observation: str
    ok: bool = True  # False: the tool rejected the call (counted as an invalid tool call)
    violations: tuple[str, ...] = ()  # sandbox violation kinds recorded during the call, lower case


class SandboxHandle:
    """The episode's sandbox, as the environment sees it: exec and files, with the task's tool limit."""

    def __init__(self, client: SandboxClient, sandbox_id: str, tool_timeout_s: float) -> None:
        self.client = client
        self.sandbox_id = sandbox_id
        self.tool_timeout_s = tool_timeout_s

    async def exec(self, argv: list[str] | tuple[str, ...], stdin: bytes | str = b"",
                   timeout_s: float | None = None, cwd: str = "") -> sandbox_pb2.ExecResult:
        return await self.client.exec(self.sandbox_id, argv, stdin, timeout_s or self.tool_timeout_s, cwd)

    async def write_files(self, files: Mapping[str, bytes | str]) -> None:
        await self.client.write_files(self.sandbox_id, files)

    async def read_files(self, paths: list[str]) -> dict[str, bytes]:
        return await self.client.read_files(self.sandbox_id, paths)


@runtime_checkable
class Environment(Protocol):
    # Read-only members, so a plain class attribute (`tools = ("search",)`) and a property both fit.
    @property
    def suite(self) -> str: ...

    @property
    def tools(self) -> tuple[str, ...]:
        """Tool names this environment can run."""

    # Optional attribute `needs_sandbox: bool` (True when absent): False runs the episode without a
    # sandbox, and `setup`/`run_tool` then get None for it.

    async def setup(self, sandbox: SandboxHandle | None, task: common_pb2.Task) -> None:
        """Prepares a fresh sandbox before the first turn (files, data); may do nothing."""

    async def run_tool(self, sandbox: SandboxHandle | None, call: ToolCall) -> ToolResult:
        """Runs one valid call of one of `tools` in the sandbox; errors are observations, not raises."""


def needs_sandbox(environment: Environment) -> bool:
    return bool(getattr(environment, "needs_sandbox", True))


class CalcEnvironment:
    """The `calc` suite: the calculator script runs in the sandbox, the expression on stdin."""

    suite = calc.SUITE
    tools = (calc.TOOL.name,)
    needs_sandbox = True

    async def setup(self, sandbox: SandboxHandle | None, task: common_pb2.Task) -> None:
        return None

    async def run_tool(self, sandbox: SandboxHandle | None, call: ToolCall) -> ToolResult:
        assert sandbox is not None
        result = await sandbox.exec(calc.CALC_TOOL_ARGV, stdin=call.args)
        if result.exit_code < 0 and not result.violations:
            # The calculator never kills itself and stays far below every limit: not the policy's doing.
            raise SandboxFailure(f"the calculator in sandbox {sandbox.sandbox_id} was killed by signal "
                                 f"{-result.exit_code} with no limit violation recorded")
        return exec_observation(result, sandbox.tool_timeout_s)


class InProcessCalcEnvironment(CalcEnvironment):
    """The `calc` suite with the calculator evaluated in the rollout worker: no sandbox, no process.

    Safe because the calculator is a bounded hand-written parser (no `eval`, no names, capped length,
    depth and magnitude) that never raises; its observations are exactly what the sandboxed script
    prints, so a policy sees the same episode either way."""

    needs_sandbox = False

    async def run_tool(self, sandbox: SandboxHandle | None, call: ToolCall) -> ToolResult:
        observation = calc.tool_observation(call.args)
        return ToolResult(observation, ok=not observation.startswith("error:"))


class CodeEnvironment:
    """The `code` suite: `write_file` (first line the path, then the contents) and `python` (run code)."""

    suite = code.SUITE
    tools = ("write_file", "python")
    needs_sandbox = True

    async def setup(self, sandbox: SandboxHandle | None, task: common_pb2.Task) -> None:
        return None

    async def run_tool(self, sandbox: SandboxHandle | None, call: ToolCall) -> ToolResult:
        assert sandbox is not None
        if call.tool == "write_file":
            return await self._write_file(sandbox, call.args)
        # `-c` puts the workspace first on sys.path, so `import solution` works from the tool.
        result = await sandbox.exec(("python3", "-c", call.args))
        return exec_observation(result, sandbox.tool_timeout_s, merge_stderr=True)

    async def _write_file(self, sandbox: SandboxHandle, args: str) -> ToolResult:
        path, _, content = args.lstrip("\n").partition("\n")
        path = path.strip()
        if not path:
            return ToolResult("error: write_file needs the file's path on its first line", ok=False)
        try:
            await sandbox.write_files({path: content})
        except RequestRejected as exc:
            return ToolResult(f"error: cannot write {path}: {exc.details}", ok=False)
        return ToolResult(f"wrote {path}")


# The edit tool, run in the sandbox as `python3 -I -S -c EDIT_SCRIPT` with {"path", "old", "new"} on stdin:
# the one occurrence of old becomes new; anything else is an error line and exit status 1.
EDIT_SCRIPT = r'''
import json, sys
job = json.loads(sys.stdin.read())
path, old, new = job["path"], job["old"], job["new"]
try:
    with open(path, encoding="utf-8") as f:
        text = f.read()
except OSError as exc:
    print(f"error: cannot read {path}: {exc.strerror}")
    sys.exit(1)
count = text.count(old) if old else 0
if count != 1:
    print(f"error: the old text occurs {count} times in {path}; it must occur exactly once")
    sys.exit(1)
with open(path, "w", encoding="utf-8") as f:
    f.write(text.replace(old, new, 1))
print(f"edited {path}")
'''
RUN_OUTPUT_CHARS = 600  # the run tool's output cap: a tiny model's context is short


class RepoEnvironment:
    """The `repo` suite: the task's workspace is written into the fresh sandbox, and every tool call is
    one process there (`find`, `cat`, `sh`, a small Python edit script), never a file RPC, so every
    call is confined and limited like the policy's own commands."""

    suite = repo.SUITE
    tools = repo.TOOL_NAMES
    needs_sandbox = True

    async def setup(self, sandbox: SandboxHandle | None, task: common_pb2.Task) -> None:
        assert sandbox is not None
        try:
            files = workspace_of(task)
        except BadTask as exc:
            raise EnvkitError(str(exc)) from None
        if files:
            await sandbox.write_files(files)

    async def run_tool(self, sandbox: SandboxHandle | None, call: ToolCall) -> ToolResult:
        assert sandbox is not None
        if call.tool == "list_files":
            result = await sandbox.exec(("find", ".", "-type", "f", "-not", "-path", "*/.*"))
            if result.exit_code != 0:
                return exec_observation(result, sandbox.tool_timeout_s)
            names = sorted(line.removeprefix("./")
                           for line in result.stdout.decode("utf-8", "replace").splitlines())
            return ToolResult("\n".join(names) or "(no files)")
        if call.tool == "run":
            return await self._run(sandbox, call.args)
        path, _, rest = call.args.lstrip("\n").partition("\n")
        path = path.strip()
        if not path:
            return ToolResult(f"error: {call.tool} needs a file path", ok=False)
        if call.tool == "read_file":
            if rest.strip():
                return ToolResult("error: read_file takes one path", ok=False)
            return exec_observation(await sandbox.exec(("cat", "--", path)), sandbox.tool_timeout_s)
        if call.tool == "write_file":
            script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'
            result = await sandbox.exec(("sh", "-c", script, "sh", path), stdin=rest)
            if result.exit_code:
                return exec_observation(result, sandbox.tool_timeout_s)
            return ToolResult(f"wrote {path}")
        old, separator, new = rest.partition(repo.EDIT_SEPARATOR)
        if not separator:
            return ToolResult("error: edit_file needs the old text, a line ---, then the new text", ok=False)
        job = json.dumps({"path": path, "old": old, "new": new})
        return exec_observation(await sandbox.exec(("python3", "-I", "-S", "-c", EDIT_SCRIPT), stdin=job),
                                sandbox.tool_timeout_s)


    async def _run(self, sandbox: SandboxHandle, command: str) -> ToolResult:
        """`sh -c command`: a failing command is a valid call (a failing test is news, not a mistake);
        its exit status ends the observation."""
        result = await sandbox.exec(("sh", "-c", command))
        seen = exec_observation(result, sandbox.tool_timeout_s, merge_stderr=True, max_chars=RUN_OUTPUT_CHARS)
        text = seen.observation
        if result.exit_code > 0 and not seen.violations:
            text += f"\n(exit status {result.exit_code})"
        return ToolResult(text, ok=not seen.violations, violations=seen.violations)


def exec_observation(result: sandbox_pb2.ExecResult, limit_s: float, merge_stderr: bool = False,
                     max_chars: int = 0) -> ToolResult:
    """The observation of one exec: its stdout (and stderr), then one error line per sandbox violation,
    or one error line when it printed nothing and failed."""
    kinds = tuple(_violation_kind(v) for v in result.violations)
    out = result.stdout.decode("utf-8", errors="replace")
    if merge_stderr:
        out += result.stderr.decode("utf-8", errors="replace")
    lines = [out.rstrip("\n")] if out.strip() else []
    for violation, kind in zip(result.violations, kinds, strict=True):
        if kind == "timeout":
            lines.append(f"error: the tool ran past its time limit of {limit_s:g} s")
        else:
            lines.append(f"error: {kind} limit: {violation.message or 'exceeded'}")
    if not lines and result.exit_code != 0:
        err = result.stderr.decode("utf-8", errors="replace").strip().splitlines()
        lines.append(err[-1] if err else f"error: the tool exited with status {result.exit_code}")
    text = "\n".join(lines) or "(no output)"
    cap = max_chars or MAX_OBSERVATION_CHARS
    if len(text) > cap:
        text = text[:cap] + f"\n... ({len(text) - cap} more characters)"
    return ToolResult(text, ok=result.exit_code == 0 and not kinds, violations=kinds)


def _violation_kind(violation: sandbox_pb2.Violation) -> str:
    return sandbox_pb2.ViolationKind.Name(violation.kind).removeprefix("VIOLATION_KIND_").lower()


class UnknownSuite(EnvkitError, LookupError):
    """No environment is registered for a task's suite (with the asked tool runtime)."""

    def __init__(self, suite: str, tool_runtime: str = "sandbox") -> None:
        self.suite = suite
        known = sorted(s for s, runtime in _REGISTRY if runtime == tool_runtime)
        if tool_runtime != "sandbox" and any(s == suite for s, _ in _REGISTRY):
            message = (f"the {suite!r} environment has no {tool_runtime} tool runtime (its tools need a "
                       f"sandbox); suites with one: {', '.join(known) or 'none'}")
        else:
            message = f"no environment for suite {suite!r}; known: {', '.join(known)}"
        super().__init__(message)


_REGISTRY: dict[tuple[str, str], Callable[[], Environment]] = {
    ("calc", "sandbox"): CalcEnvironment,
    ("calc", "in_process"): InProcessCalcEnvironment,
    ("code", "sandbox"): CodeEnvironment,
    ("repo", "sandbox"): RepoEnvironment,
}


def register_environment(suite: str, factory: Callable[[], Environment],
                         tool_runtime: ToolRuntime = "sandbox") -> None:
    """Makes `environment_for(suite, tool_runtime)` (and so the rollout workers) run `suite`
    with `factory()`."""
    _check_runtime(tool_runtime)
    _REGISTRY[(suite, tool_runtime)] = factory


def environment_for(suite: str, tool_runtime: ToolRuntime = "sandbox") -> Environment:
    _check_runtime(tool_runtime)
    try:
        return _REGISTRY[(suite, tool_runtime)]()
    except KeyError:
        raise UnknownSuite(suite, tool_runtime) from None


def environments(tool_runtime: ToolRuntime) -> Callable[[str], Environment]:
    """The environment factory of a worker preferring `tool_runtime`: a suite without that runtime (its
    tools run model-written code, like `code`) still gets its sandboxed environment."""
    _check_runtime(tool_runtime)

    def factory(suite: str) -> Environment:
        runtime = tool_runtime if (suite, tool_runtime) in _REGISTRY else "sandbox"
        return environment_for(suite, runtime)

    return factory


def known_suites() -> list[str]:
    return sorted({suite for suite, _ in _REGISTRY})


def _check_runtime(tool_runtime: str) -> None:
    if tool_runtime not in TOOL_RUNTIMES:
        raise ValueError(f"unknown tool runtime {tool_runtime!r}; expected one of {', '.join(TOOL_RUNTIMES)}")
