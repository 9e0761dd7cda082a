"""The ``repo`` suite: small multi-file Python repositories with a bug to fix or a function to write.

Every task is a workspace (the task's public ``workspace`` files, written into the episode's fresh
sandbox before the first turn), a prompt naming the symptom and the test command, and hidden tests
the verifier runs in a sandbox of its own against the repository's modules (never the policy's
sandbox, through the supervised harness: ``services/verifier/README.md``). The workspace's own
``test_<module>.py`` checks one visible case; the hidden tests check others.

Difficulty levels (all generated here, deterministic in split, n, seed and level):

1. **fix**: a module of two functions, one with a one-line bug; the prompt names the file and the
   function. Ideal: read the file, edit the line, run the tests, answer.
2. **fix, one import away**: the prompt names a function of ``<module>.py`` that calls into a helper
   module, where the bug is. Ideal: list the files, read both, edit the helper, run, answer.
3. **implement**: a function's body is ``raise NotImplementedError``; the prompt gives its spec.
   Ideal: read, replace the stub by the body, run, answer.

Tools (each call one process in the episode's sandbox, ``rlfleet.envkit.sdk.environment.RepoEnvironment``):

    <list_files></list_files>               the workspace's files
    <read_file>PATH</read_file>             a file's text
    <write_file>PATH\\nTEXT</write_file>    (over)writes a file
    <edit_file>PATH\\nOLD\\n---\\nNEW</edit_file>  replaces the one occurrence of OLD by NEW
    <run>COMMAND</run>                      ``sh -c COMMAND``: its own time limit, output capped
    <answer>done</answer>                   ends the episode; the hidden tests decide the reward

Splits are a pure function of the instance (a hash), as in ``calc``: train, heldout and regression
never overlap; held-out tasks are the same functions in repositories never trained on (other
modules, companions, layouts). The regression split ignores ``seed``.

Task metadata (the verifier's only) names the ``failure_modes`` a policy can show on the task:
the bug's kind (``wrong_operator``, ``off_by_one``, ...), and the generic ones every task has
(``no_edit``, ``wrong_edit``, ``edit_mismatch``, ``wrong_file``, ``no_answer``).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any

from rlfleet.envkit.errors import TaskGenerationError
from rlfleet.envkit.suite_format import Limits, Message, Task, ToolSpec, UnitTestsVerifier
from rlfleet.envkit.suites.hidden_tests import hidden_test_script
from rlfleet.envkit.suites.repo_templates import FUNCTIONS, HELPER_MODULES, MODULES, Bug, FunctionTemplate

SUITE = "repo"
LEVELS = (1, 2, 3)
EDIT_SEPARATOR = "\n---\n"
SYSTEM_PROMPT = (
    "You fix Python repositories. Tools: <list_files></list_files>, <read_file>path</read_file>, "
    "<write_file>path\ncontents</write_file>, <edit_file>path\nold text\n---\nnew text</edit_file>, "
    "<run>shell command</run>. When the tests pass, reply <answer>done</answer>."
)
TOOLS = (
    ToolSpec(name="list_files", description="lists the workspace's files"),
    ToolSpec(name="read_file", description="the path; returns the file's text"),
    ToolSpec(name="write_file", description="first line: the path; the rest: the file's contents"),
    ToolSpec(name="edit_file",
             description="first line: the path; then the old text, a line ---, the new text"),
    ToolSpec(name="run", description="runs a shell command in the workspace (time limit, output capped)"),
)
TOOL_NAMES = tuple(tool.name for tool in TOOLS)
LIMITS = {
    1: Limits(max_turns=4, max_new_tokens=64, timeout_s=120.0, tool_timeout_s=5.0),
    2: Limits(max_turns=6, max_new_tokens=64, timeout_s=120.0, tool_timeout_s=5.0),
    3: Limits(max_turns=4, max_new_tokens=96, timeout_s=120.0, tool_timeout_s=5.0),
}
HIDDEN_TIMEOUT_S = 10.0
GENERIC_FAILURE_MODES = ("no_edit", "wrong_edit", "edit_mismatch", "wrong_file", "no_answer")
_REGRESSION_PCT, _HELDOUT_PCT = 5, 15
REGRESSION_SEED = 20240601

_VISIBLE_TEST = '''\
import sys
from {module} import {function}

failed = 0
for args, expected in {cases!r}:
    try:
        got = {function}(*args)
    except Exception as exc:
        got = f"raised {{type(exc).__name__}}"
    if got != expected:
        failed += 1
        print(f"FAIL {function}{{args}}: got {{got!r}}, expected {{expected!r}}")
print("all tests passed" if not failed else f"{{failed}} failed")
sys.exit(1 if failed else 0)
'''

@dataclass(frozen=True)
class Instance:
    """One repository: which function, which bug, in which module, next to which companion."""

    level: int
    function: FunctionTemplate
    bug: Bug | None  # None at level 3 (a stub to implement)
    module: str
    companion: FunctionTemplate
    helper: str = ""  # level 2: the module the bug is in
    companion_first: bool = False

    @property
    def key(self) -> str:
        bug = self.bug.kind if self.bug else "stub"
        return (f"{self.level}:{self.function.name}:{bug}:{self.module}:{self.helper}:{self.companion.name}:"
                f"{int(self.companion_first)}")

    @property
    def target_file(self) -> str:
        """The file the fix goes in."""
        return f"{self.helper or self.module}.py"

    @property
    def test_file(self) -> str:
        return f"test_{self.module}.py"

    @property
    def wrapper(self) -> str:
        return f"{self.function.name}_all"

    def library_source(self) -> str:
        """The module holding the target function (the helper at level 2)."""
        target = self.function.source(self.bug, stub=self.level == 3)
        companion = self.companion.source()
        parts = [companion, target] if self.companion_first else [target, companion]
        return "\n\n".join(parts)

    def visible_cases(self) -> tuple[str, str, list]:
        """(module, function, cases) the workspace's test file checks."""
        if self.level != 2:
            return self.module, self.function.name, list(self.function.visible)
        items = [list(args) for args, _ in self.function.visible]
        return self.module, self.wrapper, [((items,), [expected for _, expected in self.function.visible])]

    def workspace(self) -> dict[str, str]:
        module, function, cases = self.visible_cases()
        files = {self.target_file: self.library_source(),
                 self.test_file: _VISIBLE_TEST.format(module=module, function=function, cases=cases)}
        if self.level == 2:
            name = self.function.name
            files[f"{self.module}.py"] = (
                f"from {self.helper} import {name}\n\n\ndef {self.wrapper}(items):\n"
                f"    \"\"\"Applies {name}() to each argument list in items.\"\"\"\n"
                f"    return [{name}(*args) for args in items]\n")
        return files

    def visible_output(self, target_text: str) -> tuple[str, int]:
        """What `python3 <test_file>` prints and its exit status, with `target_text` as the target file
        (the rest of the workspace as generated): the test file's logic, evaluated here on trusted
        template code, for demonstrations that must show the very observation a sandbox would."""
        namespace: dict[str, Any] = {}
        exec(compile(target_text, self.target_file, "exec"), namespace)
        target = namespace[self.function.name]
        call = (lambda items: [target(*args) for args in items]) if self.level == 2 else target
        _, function, cases = self.visible_cases()
        lines = []
        for args, expected in cases:
            try:
                got = call(*args)
            except Exception as exc:
                got = f"raised {type(exc).__name__}"
            if got != expected:
                lines.append(f"FAIL {function}{args}: got {got!r}, expected {expected!r}")
        lines.append("all tests passed" if not lines else f"{len(lines)} failed")
        return "\n".join(lines), int(len(lines) > 1)

    def prompt(self) -> str:
        f = self.function
        check = f"Check with: python3 {self.test_file}"
        if self.level == 1:
            return f"{f.name}() in {self.module}.py {f.doc}, but it has a bug. Fix it. {check}"
        if self.level == 2:
            return (f"{self.wrapper}() in {self.module}.py gives wrong results. Find the bug and fix it. "
                    f"{check}")
        return f"Implement {f.name}() in {self.module}.py: it {f.doc}. {check}"

    def hidden_cases(self) -> list[tuple[str, str, list[Any], Any]]:
        target_module = self.helper or self.module
        cases = [(target_module, self.function.name, list(args), expected)
                 for args, expected in self.function.hidden]
        if self.level == 2:
            items = [list(args) for args, _ in self.function.hidden]
            cases.append((self.module, self.wrapper, [items],
                          [expected for _, expected in self.function.hidden]))
        return cases

    def hidden_tests(self) -> str:
        return hidden_test_script(title="Hidden tests:", cases=self.hidden_cases(), imports=("importlib",),
                                  case="(module, function, args, expected)", name='f"test_{index}"',
                                  call="getattr(importlib.import_module(module), function)(*args)",
                                  mismatch="returned {got!r}")

    def solution_files(self) -> tuple[str, ...]:
        return tuple(sorted(path for path in self.workspace() if path != self.test_file))

    def fix(self) -> tuple[str, str]:
        """(old, new) of the reference edit of ``target_file``."""
        if self.bug is not None:
            indent = "    "
            return indent + self.bug.buggy, indent + self.bug.line
        return "    raise NotImplementedError", "\n".join(self.function.body_lines())

    def failure_modes(self) -> list[str]:
        return [self.bug.kind if self.bug else "not_implemented", *GENERIC_FAILURE_MODES]


def split_of(instance: Instance) -> str:
    bucket = _digest(instance.key) % 100
    if bucket < _REGRESSION_PCT:
        return "regression"
    return "heldout" if bucket < _REGRESSION_PCT + _HELDOUT_PCT else "train"


def random_instance(rng: random.Random, level: int) -> Instance:
    function = rng.choice(FUNCTIONS)
    companion = rng.choice([f for f in FUNCTIONS if f.name != function.name])
    bug = rng.choice(function.bugs) if level != 3 else None
    helper = rng.choice(HELPER_MODULES) if level == 2 else ""
    return Instance(level, function, bug, rng.choice(MODULES), companion, helper, rng.random() < 0.5)


def make_task(instance: Instance) -> Task:
    return Task(
        task_id=f"repo-{instance.level}-{_hex(instance.key)[:12]}",
        suite=SUITE,
        split=split_of(instance),
        messages=(Message(role="system", content=SYSTEM_PROMPT),
                  Message(role="user", content=instance.prompt())),
        workspace=instance.workspace(),
        verifier=UnitTestsVerifier(kind="unit_tests", tests=instance.hidden_tests(),
                                   test_file="test_hidden.py", solution_files=instance.solution_files(),
                                   timeout_s=HIDDEN_TIMEOUT_S),
        tools=TOOLS,
        limits=LIMITS[instance.level],
        metadata={"level": instance.level, "function": instance.function.name, "module": instance.module,
                  "helper": instance.helper, "target_file": instance.target_file,
                  "test_file": instance.test_file,
                  "bug": instance.bug.kind if instance.bug else "not_implemented",
                  "failure_modes": instance.failure_modes(), "instance": instance.key},
    )


def generate_instances(split: str, n: int, seed: int = 0,
                       difficulty: int | tuple[int, ...] = 1) -> list[Instance]:
    """``n`` distinct instances of ``split``; ``difficulty`` one level or several (mixed evenly)."""
    levels = (difficulty,) if isinstance(difficulty, int) else tuple(difficulty)
    for level in levels:
        if level not in LEVELS:
            raise ValueError(f"unknown difficulty {level!r}; expected one of {list(LEVELS)}")
    if split not in ("train", "heldout", "regression"):
        raise ValueError(f"unknown split {split!r}; expected train, heldout or regression")
    if split == "regression":
        seed = REGRESSION_SEED
    rng = random.Random(f"{SUITE}:{split}:{levels}:{seed}")
    found: dict[str, Instance] = {}
    for attempt in range(200 * n + 2000):
        if len(found) == n:
            break
        instance = random_instance(rng, levels[attempt % len(levels)])
        if instance.key not in found and split_of(instance) == split:
            found[instance.key] = instance
    if len(found) < n:
        raise TaskGenerationError(f"could only find {len(found)} of {n} distinct {split} "
                                  f"repo tasks at {levels}")
    return list(found.values())


def generate_tasks(split: str, n: int, seed: int = 0, difficulty: int | tuple[int, ...] = 1) -> list[Task]:
    """``n`` distinct tasks of ``split``, deterministic in (split, n, seed, difficulty)."""
    return [make_task(instance) for instance in generate_instances(split, n, seed, difficulty)]


def instance_of(task: Task) -> Instance:
    """The instance a task was generated from (for demonstrations and tests; never a prompt)."""
    level, name, bug_kind, module, helper, companion, first = task.metadata["instance"].split(":")
    function = next(f for f in FUNCTIONS if f.name == name)
    bug = next((b for b in function.bugs if b.kind == bug_kind), None)
    return Instance(int(level), function, bug, module,
                    next(f for f in FUNCTIONS if f.name == companion), helper, first == "1")


def fixed_workspace(task: Task) -> dict[str, str]:
    """The workspace with the reference fix applied (what a correct episode leaves behind)."""
    instance = instance_of(task)
    files = dict(task.workspace)
    old, new = instance.fix()
    files[instance.target_file] = files[instance.target_file].replace(old, new, 1)
    return files


def _hex(key: str) -> str:
    return hashlib.sha256(f"{SUITE}:{key}".encode()).hexdigest()


def _digest(key: str) -> int:
    return int(_hex(key)[:16], 16)
