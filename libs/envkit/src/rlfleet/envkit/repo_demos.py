"""Demonstrations of the ``repo`` suite for the supervised warm start, deliberately imperfect.

As for ``calc`` (``rlfleet.envkit.demos``), ``imperfection`` is the probability that a
demonstration carries a flaw instead of being the ideal episode, so the warm-started policy learns
the tools and the shape of a fix but often gets it wrong, and RL has something to gain:

Flaw (share of the flawed demos)  what the demo does                                     passes
- ``no_edit`` (30%)               reads, runs the tests, answers without changing a thing  never
- ``wrong_edit`` (30%)            edits the right line into another wrong one, answers     never
- ``edit_mismatch`` (25%)         miscopies the old text (the edit is refused), then       half the time
                                  retries it right or gives up
- ``malformed_call`` (15%)        a broken tag, gets the error back, then does it right    half the time
                                  or gives up

So at imperfection ``p`` about ``1 - 0.8 p`` of the demos pass (0.6 at 0.5). Every observation
is exactly what the sandboxed tool returns (the visible test's output is computed by
``Instance.visible_output``), and every record names its flaw (``"none"`` for the ideal one).
"""

from __future__ import annotations

import random
from typing import Any

from rlfleet.envkit.actions import InvalidCall, parse_action
from rlfleet.envkit.suites import repo
from rlfleet.envkit.suites.repo import Instance

FLAWS: dict[str, float] = {"no_edit": 0.30, "wrong_edit": 0.30, "edit_mismatch": 0.25, "malformed_call": 0.15}
RETRY = 0.5  # after a refused edit or a malformed call, the demo does it right this often (else gives up)
DEFAULT_IMPERFECTION = 0.5
# Plausible wrong rewrites of a line, tried in order: the first that changes it is the wrong edit.
_WRONG_REWRITES = (("+", "-"), ("*", "+"), (">=", ">"), ("<", "<="), ("==", "!="),
                   ("max", "min"), ("min", "max"), ("[-1]", "[1]"), ("[:n]", "[1:n]"), ("in ", "not in "),
                   ("' '", "','"), ("100", "10"),
                   ("1", "2"), ("0", "1"), ("<", ">"), ("return ", "return -"))


def generate_demos(n: int, seed: int = 0, imperfection: float = DEFAULT_IMPERFECTION,
                   difficulty: int | tuple[int, ...] = 1) -> list[dict[str, Any]]:
    """``n`` JSONL-ready records ``{"messages", "task_id", "flaw"}`` from distinct train tasks."""
    if not 0.0 <= imperfection <= 1.0:
        raise ValueError(f"imperfection must be in [0, 1], got {imperfection}")
    rng = random.Random(f"repo-demos:{seed}:{imperfection}:{difficulty}")
    demos = []
    for task in repo.generate_tasks("train", n, seed=seed, difficulty=difficulty):
        flawed = rng.random() < imperfection  # drawn first, as before the choice of flaw
        flaw = rng.choices(list(FLAWS), weights=list(FLAWS.values()))[0] if flawed else "none"
        instance = repo.instance_of(task)
        turns = _TURNS[flaw](_Demo(instance, dict(task.workspace)), rng)
        demos.append({"messages": task.chat_messages() + turns, "task_id": task.task_id, "flaw": flaw})
    return demos


class _Demo:
    """Builds one episode's turns, keeping the workspace as the tools would leave it."""

    def __init__(self, instance: Instance, files: dict[str, str]) -> None:
        self.instance = instance
        self.files = files
        self.turns: list[dict[str, str]] = []

    def call(self, text: str, observation: str) -> _Demo:
        self.turns += [{"role": "assistant", "content": text}, {"role": "tool", "content": observation}]
        return self

    def list_files(self) -> _Demo:
        return self.call("<list_files></list_files>", "\n".join(sorted(self.files)))

    def read(self, path: str) -> _Demo:
        return self.call(f"<read_file>{path}</read_file>", self.files[path].rstrip("\n"))

    def explore(self) -> _Demo:
        """What the ideal episode reads before its edit: the file, or (level 2) the files and both modules."""
        if self.instance.level == 2:
            self.list_files().read(f"{self.instance.module}.py")
        return self.read(self.instance.target_file)

    def edit(self, old: str, new: str) -> _Demo:
        path = self.instance.target_file
        text = self.files[path]
        count = text.count(old)
        if count != 1:
            observation = f"error: the old text occurs {count} times in {path}; it must occur exactly once"
        else:
            self.files[path] = text.replace(old, new, 1)
            observation = f"edited {path}"
        return self.call(f"<edit_file>{path}\n{old}{repo.EDIT_SEPARATOR}{new}</edit_file>", observation)

    def run_tests(self) -> _Demo:
        output, status = self.instance.visible_output(self.files[self.instance.target_file])
        observation = output + (f"\n(exit status {status})" if status else "")
        return self.call(f"<run>python3 {self.instance.test_file}</run>", observation)

    def answer(self) -> list[dict[str, str]]:
        return [*self.turns, {"role": "assistant", "content": "<answer>done</answer>"}]


def _ideal(demo: _Demo, rng: random.Random | None = None) -> list[dict[str, str]]:
    return demo.explore().edit(*demo.instance.fix()).run_tests().answer()


def _no_edit(demo: _Demo, rng: random.Random) -> list[dict[str, str]]:
    return demo.explore().run_tests().answer()


def _wrong_edit(demo: _Demo, rng: random.Random) -> list[dict[str, str]]:
    old, right = demo.instance.fix()
    return demo.explore().edit(old, wrong_rewrite(right, old)).run_tests().answer()


def _edit_mismatch(demo: _Demo, rng: random.Random) -> list[dict[str, str]]:
    old, new = demo.instance.fix()
    demo.explore().edit(old.strip() + " ", new)  # the indentation dropped, a space added: not in the file
    if rng.random() < RETRY:
        return demo.edit(old, new).run_tests().answer()
    return demo.answer()


def _malformed_call(demo: _Demo, rng: random.Random) -> list[dict[str, str]]:
    path = demo.instance.target_file if demo.instance.level != 2 else f"{demo.instance.module}.py"
    text = rng.choice((f"<read_file>{path}", f"<read_file>{path}</run>", f"<open>{path}</open>",
                       f"{path}</read_file>"))
    action = parse_action(text, repo.TOOL_NAMES)
    if not isinstance(action, InvalidCall):  # the observation must be exactly what a worker would send
        raise RuntimeError(f"{text!r} was meant to be an invalid call, parsed as {action}")
    demo.call(text, action.error)
    return _ideal(demo) if rng.random() < RETRY else demo.answer()


_TURNS = {"none": _ideal, "no_edit": _no_edit, "wrong_edit": _wrong_edit, "edit_mismatch": _edit_mismatch,
          "malformed_call": _malformed_call}


def wrong_rewrite(right: str, old: str) -> str:
    """A plausible rewrite of the right line(s) that is neither right nor the original bug."""
    for before, after in _WRONG_REWRITES:
        candidate = right.replace(before, after, 1)
        if candidate not in (right, old) and compiles(candidate):
            return candidate
    return right.replace("return ", "return 0 * ", 1)


def compiles(lines: str) -> bool:
    """Whether body lines (one opening a block, like `if x < 0:`, too) are valid Python."""
    block = "\n        pass" if lines.rstrip().endswith(":") else ""
    try:
        compile(f"def f(a, b, x, n, xs, s):\n{lines}{block}\n", "<rewrite>", "exec")
    except SyntaxError:
        return False
    return True
