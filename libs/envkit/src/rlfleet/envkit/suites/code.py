"""The ``code`` suite: "write a small Python function in solution.py", scored by hidden unit tests.

The policy gets a prompt with the function's signature and two tools (``write_file``,
``python``). The verifier later runs the hidden test script (never shown to the policy) in its own
sandbox next to the candidate's ``solution.py``. The script's contract, which the ``unit_tests``
verifier kind parses: one ``PASS <name>`` or ``FAIL <name>: <why>`` line per test, then a final
``RESULT passed=<p> failed=<f>`` line, and exit status 0 only when every test passed.

The verifier never runs this script next to candidate code: its supervisor replaces ``solution``
with a proxy whose every call runs in a fresh process and returns only data, so a fake RESULT line
or ``os._exit(0)`` in the candidate reaches nothing (``services/verifier/README.md``).
"""

from __future__ import annotations

import hashlib
import random

from rlfleet.envkit.errors import TaskGenerationError
from rlfleet.envkit.suite_format import Limits, Message, Task, ToolSpec, UnitTestsVerifier
from rlfleet.envkit.suites.code_templates import TEMPLATES, CodeTemplate
from rlfleet.envkit.suites.hidden_tests import hidden_test_script

SUITE = "code"
SOLUTION_FILE = "solution.py"
TEST_FILE = "test_hidden.py"
SYSTEM_PROMPT = (
    "You write Python code. Save a file with <write_file>path\ncontents</write_file> and run Python "
    "with <python>code</python>. When the file is ready, reply <answer>done</answer>."
)
TOOLS = (
    ToolSpec(name="write_file", description="first line: the path; the rest: the file's contents"),
    ToolSpec(name="python", description="runs Python code in the workspace and returns its output"),
)
LIMITS = Limits(max_turns=6, max_new_tokens=512, timeout_s=120.0, tool_timeout_s=10.0)
_HELDOUT_PCT = 25

_IMPORT_CANDIDATE = '''\
    try:
        from solution import {function} as candidate
    except BaseException as exc:  # SystemExit at import too: it must not end the run early
        print(f"FAIL import_solution: {{type(exc).__name__}}: {{exc}}")
        print("RESULT passed=0 failed=1")
        return 1
'''


def split_of(function: str) -> str:
    bucket = int(hashlib.sha256(f"{SUITE}:{function}".encode()).hexdigest()[:8], 16) % 100
    return "heldout" if bucket < _HELDOUT_PCT else "train"


def build_test_script(template: CodeTemplate) -> str:
    function = template.function
    cases = [(list(args), expected) for args, expected in template.cases]
    return hidden_test_script(title=f"Hidden tests for {function}();", cases=cases, case="(args, expected)",
                              name=f'f"test_{function}_{{index}}"', call="candidate(*args)",
                              mismatch=function + "{tuple(args)!r} returned {got!r}, expected {expected!r}",
                              preamble='sys.path.insert(0, ".")\n',
                              setup=_IMPORT_CANDIDATE.format(function=function))


def prompt_of(template: CodeTemplate) -> str:
    return f"Write a Python function `{template.signature}` in {SOLUTION_FILE} that {template.description}."


def make_task(template: CodeTemplate) -> Task:
    return Task(
        task_id=f"code-{template.function}",
        suite=SUITE,
        split=split_of(template.function),
        messages=(
            Message(role="system", content=SYSTEM_PROMPT),
            Message(role="user", content=prompt_of(template)),
        ),
        verifier=UnitTestsVerifier(
            kind="unit_tests",
            tests=build_test_script(template),
            test_file=TEST_FILE,
            solution_files=(SOLUTION_FILE,),
        ),
        tools=TOOLS,
        limits=LIMITS,
        metadata={"function": template.function, "signature": template.signature},
    )


def generate_tasks(split: str, n: int | None = None, seed: int = 0, difficulty: int = 1) -> list[Task]:
    """``n`` tasks of ``split`` (all of them when None), in an order shuffled by ``seed``."""
    if split not in ("train", "heldout"):
        raise ValueError(f"the code suite has splits train and heldout, not {split!r}")
    if difficulty != 1:
        raise ValueError("the code suite has a single difficulty, 1")
    tasks = [make_task(t) for t in TEMPLATES if split_of(t.function) == split]
    random.Random(f"{SUITE}:{split}:{seed}").shuffle(tasks)
    if n is None:
        return tasks
    if n > len(tasks):
        raise TaskGenerationError(f"the code suite has {len(tasks)} {split} tasks, {n} were asked for")
    return tasks[:n]


def reference_solution(task: Task) -> str:
    """The reference ``solution.py`` of a code task (for demonstrations and tests; never a prompt)."""
    function = task.metadata["function"]
    return next(t.solution for t in TEMPLATES if t.function == function)
