"""The task-suite file format: JSONL, one task per line (docs/task-suites.md).

Every line is validated strictly (unknown keys are errors) so that a typo in a hand-written suite
fails loudly at load time with its line number, instead of silently training on a task whose
answer key was never read. A task splits into a **public** part, which rollout workers and the
policy see, and a **hidden** part (answers, tests), which only the verifier sees.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from rlfleet.common.config import StrictModel
from rlfleet.envkit.errors import SuiteFormatError

SCHEMA_VERSION: Final = 1  # Final: its type is Literal[1], what `Task.schema_version` takes
SPLITS = ("train", "heldout", "regression")
VERIFIER_KINDS = ("exact", "numeric", "unit_tests")
# Keys a rollout worker may see. Everything else (verifier, metadata) stays with the verifier.
PUBLIC_KEYS = ("schema_version", "task_id", "suite", "split", "messages", "tools", "limits", "workspace")
HIDDEN_KEYS = ("task_id", "suite", "verifier", "metadata")


class _Record(StrictModel):
    # A task is a record read from a file: immutable once read.
    model_config = ConfigDict(frozen=True)


class Message(_Record):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ToolSpec(_Record):
    name: str = Field(pattern=r"^[a-z_]+$", description="the tag name, as in <name>args</name>")
    description: str = ""

    @field_validator("name")
    @classmethod
    def _not_answer(cls, name: str) -> str:
        if name == "answer":
            raise ValueError("'answer' is reserved for the final answer and cannot be a tool")
        return name


class Limits(_Record):
    max_turns: int = Field(4, ge=0, description="tool calls allowed; the episode gets max_turns + 1 turns")
    max_new_tokens: int = Field(256, gt=0, description="token budget of one assistant turn")
    timeout_s: float = Field(60.0, gt=0, description="wall-clock budget of the whole episode")
    tool_timeout_s: float = Field(10.0, gt=0, description="wall-clock budget of one tool call")


class ExactVerifier(_Record):
    """Pass when the answer equals ``answer`` after normalisation (strip, collapse spaces, NFKC)."""

    kind: Literal["exact"]
    answer: str
    case_sensitive: bool = False


class NumericVerifier(_Record):
    """Pass when the answer is a number within ``tolerance`` (absolute) of ``answer``."""

    kind: Literal["numeric"]
    answer: str
    tolerance: float = Field(0.0, ge=0)

    @field_validator("answer")
    @classmethod
    def _is_number(cls, answer: str) -> str:
        try:
            finite = math.isfinite(float(answer.replace(",", "")))
        except ValueError:
            finite = False
        if not finite:
            raise ValueError(f"answer {answer!r} is not a finite number")
        return answer


class UnitTestsVerifier(_Record):
    """Pass when the hidden test script, run against the candidate's files, reports no failure."""

    kind: Literal["unit_tests"]
    tests: str = Field(min_length=1, description="the hidden test script (Python)")
    test_file: str = "test_hidden.py"
    solution_files: tuple[str, ...] = Field(("solution.py",), min_length=1)
    timeout_s: float = Field(10.0, gt=0)


VerifierSpec = Annotated[ExactVerifier | NumericVerifier | UnitTestsVerifier, Field(discriminator="kind")]


class Task(_Record):
    schema_version: Literal[1] = SCHEMA_VERSION
    task_id: str = Field(min_length=1)
    suite: str = Field(min_length=1)
    split: Literal["train", "heldout", "regression"]
    prompt: str | None = None
    messages: tuple[Message, ...] | None = None
    verifier: VerifierSpec
    tools: tuple[ToolSpec, ...] = ()
    limits: Limits = Limits()
    # Files the episode's sandbox starts with (path -> text): public, the policy reads them with its tools.
    workspace: dict[str, str] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_prompt(self) -> Task:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        if self.messages is not None and not any(m.role == "user" for m in self.messages):
            raise ValueError("'messages' has no user message")
        names = [tool.name for tool in self.tools]
        if len(names) != len(set(names)):
            raise ValueError(f"duplicate tool names in {names}")
        return self

    def chat_messages(self) -> list[dict[str, str]]:
        """The conversation the rollout worker renders: ``messages``, or the prompt as one user turn."""
        if self.messages is not None:
            return [m.model_dump() for m in self.messages]
        return [{"role": "user", "content": self.prompt or ""}]

    @property
    def tool_names(self) -> list[str]:
        return [tool.name for tool in self.tools]


def public_view(task: Task) -> dict[str, Any]:
    """What a rollout worker (and so the policy) may see: prompt as messages, tools, limits."""
    data = task.model_dump(mode="json")
    view = {key: data[key] for key in PUBLIC_KEYS if key != "messages"}
    view["messages"] = task.chat_messages()
    return view


def hidden_view(task: Task) -> dict[str, Any]:
    """What only the verifier sees: the verifier spec (answer, tests) and the metadata."""
    data = task.model_dump(mode="json")
    return {key: data[key] for key in HIDDEN_KEYS}


def task_to_line(task: Task) -> str:
    data = task.model_dump(mode="json", exclude_none=True)
    if not data["workspace"]:
        del data["workspace"]  # most suites have none: their lines stay as they were
    return json.dumps(data, ensure_ascii=False)


def parse_task_line(text: str, line: int = 1, path: str | None = None) -> Task:
    """One JSONL line as a Task, or a :class:`SuiteFormatError` naming the line and the problem."""
    try:
        data = json.loads(text.rstrip("\r\n"))
    except json.JSONDecodeError as exc:
        raise SuiteFormatError(line, f"invalid JSON: {exc.msg} (column {exc.colno})", path) from None
    if not isinstance(data, dict):
        raise SuiteFormatError(line, f"expected a JSON object, got {type(data).__name__}", path)
    kind = data.get("verifier", {}).get("kind") if isinstance(data.get("verifier"), dict) else None
    if kind is not None and kind not in VERIFIER_KINDS:
        known = ", ".join(VERIFIER_KINDS)
        raise SuiteFormatError(line, f"verifier.kind: unknown verifier kind {kind!r} (known: {known})", path)
    try:
        return Task.model_validate(data)
    except ValidationError as exc:
        raise SuiteFormatError(line, _describe(exc), path) from None


def iter_suite(path: str | Path) -> Iterator[Task]:
    """Tasks of a suite file in order; blank lines are skipped, task IDs must be unique."""
    seen: dict[str, int] = {}
    with open(path, encoding="utf-8") as lines:
        for number, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            task = parse_task_line(text, number, str(path))
            if task.task_id in seen:
                message = f"duplicate task_id {task.task_id!r} (first on line {seen[task.task_id]})"
                raise SuiteFormatError(number, message, str(path))
            seen[task.task_id] = number
            yield task


def load_suite(path: str | Path) -> list[Task]:
    return list(iter_suite(path))


def write_suite(tasks: Iterable[Task], path: str | Path) -> int:
    """Writes tasks as JSONL (parent folders created); returns how many lines were written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with open(path, "w", encoding="utf-8") as out:
        for task in tasks:
            out.write(task_to_line(task) + "\n")
            count += 1
    return count


def _describe(exc: ValidationError) -> str:
    """Pydantic's errors as ``field.path: what is wrong`` joined by '; '."""
    parts = []
    for error in exc.errors():
        # Discriminated unions put the tag in the location ("verifier.numeric.answer"); drop it.
        loc = [str(p) for p in error["loc"] if p not in VERIFIER_KINDS]
        where = ".".join(loc) or "task"
        parts.append(f"{where}: {error['msg']}")
    return "; ".join(parts)
