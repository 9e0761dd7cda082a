"""The ``calc`` suite: a multi-turn calculator agent, small enough for a tiny model to learn.

Ideal episode::

    user       What is 37*48+5?
    assistant  <calc>37*48+5</calc>
    tool       1781
    assistant  <answer>1781</answer>

The policy never has to do arithmetic, only to copy the expression into the tool and the tool's
result into the answer; that is learnable by a few-million-parameter model, and the imperfect
demonstrations (``rlfleet.envkit.demos``) leave room for RL to improve on.

Splits are a pure function of the expression (a hash), so train, heldout and regression tasks can
never overlap whatever seed or ``n`` is asked for. The regression split ignores ``seed``: it is the
same fixed list every time, and a longer request only extends it.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

from rlfleet.envkit.errors import TaskGenerationError
from rlfleet.envkit.suite_format import Limits, Message, NumericVerifier, Task, ToolSpec
from rlfleet.envkit.suites import calc_tool
from rlfleet.envkit.suites.calc_tool import evaluate_expression

SUITE = "calc"
SYSTEM_PROMPT = (
    "You are a calculator agent. Call the calculator as <calc>expression</calc>; "
    "it replies with the result. Then reply <answer>result</answer>."
)
TOOL = ToolSpec(name="calc", description="evaluates integers with + - * / // % ( )")
# Two calls are plenty for one expression; the third is slack for a retry after an error.
LIMITS = Limits(max_turns=3, max_new_tokens=48, timeout_s=30.0, tool_timeout_s=5.0)

# The sandbox runs this text as a script: `python3 -I -S -c SCRIPT` with the expression on stdin
# (or as the arguments after the script). It prints the result or `error: ...` and exits 1 on error.
# -S: the script needs only the standard library, and skipping `site` (its .pth files) cuts the
# interpreter's start from ~50 to ~13 ms of CPU here: a tool call's largest cost, paid per call.
CALC_TOOL_SCRIPT = Path(calc_tool.__file__).read_text(encoding="utf-8")
CALC_TOOL_ARGV = ("python3", "-I", "-S", "-c", CALC_TOOL_SCRIPT)

# Operand ranges and expression shapes per difficulty; letters are filled with random integers.
DIFFICULTIES: dict[int, tuple[tuple[int, int], tuple[str, ...]]] = {
    1: ((10, 99), ("a+b", "a-b", "a*b")),
    2: ((10, 999), ("a*b+c", "a*b-c", "a+b*c", "a+b-c")),
    3: ((10, 999), ("(a+b)*c", "a*(b-c)", "(a-b)*(c+d)", "(a+b)*c-d")),
}
# Percent of all expressions per split, decided by hash: [0, 5) regression, [5, 20) heldout.
_REGRESSION_PCT, _HELDOUT_PCT = 5, 15
REGRESSION_SEED = 20240601


def split_of(expression: str) -> str:
    bucket = _digest(expression) % 100
    if bucket < _REGRESSION_PCT:
        return "regression"
    return "heldout" if bucket < _REGRESSION_PCT + _HELDOUT_PCT else "train"


def task_id_of(expression: str, difficulty: int) -> str:
    return f"calc-{difficulty}-{_hex(expression)[:12]}"


def prompt_of(expression: str) -> str:
    return f"What is {expression}?"


def tool_observation(args: str) -> str:
    """What the sandboxed tool prints for ``args``; in-process, for tests and demonstrations."""
    return evaluate_expression(args)


def random_expression(rng: random.Random, difficulty: int) -> str:
    (lo, hi), shapes = _level(difficulty)
    shape = rng.choice(shapes)
    return "".join(str(rng.randint(lo, hi)) if ch.isalpha() else ch for ch in shape)


def make_task(expression: str, difficulty: int) -> Task:
    return Task(
        task_id=task_id_of(expression, difficulty),
        suite=SUITE,
        split=split_of(expression),
        messages=(
            Message(role="system", content=SYSTEM_PROMPT),
            Message(role="user", content=prompt_of(expression)),
        ),
        verifier=NumericVerifier(kind="numeric", answer=evaluate_expression(expression), tolerance=0.0),
        tools=(TOOL,),
        limits=LIMITS,
        metadata={"expression": expression, "difficulty": difficulty},
    )


def generate_tasks(split: str, n: int, seed: int = 0, difficulty: int = 1) -> list[Task]:
    """``n`` distinct tasks of ``split``, deterministic in (split, n, seed, difficulty)."""
    _level(difficulty)
    if split not in ("train", "heldout", "regression"):
        raise ValueError(f"unknown split {split!r}; expected train, heldout or regression")
    if split == "regression":
        seed = REGRESSION_SEED
    rng = random.Random(f"{SUITE}:{split}:{difficulty}:{seed}")
    tasks: dict[str, Task] = {}
    for _ in range(50 * n + 1000):
        if len(tasks) == n:
            return list(tasks.values())
        expression = random_expression(rng, difficulty)
        if expression not in tasks and split_of(expression) == split:
            tasks[expression] = make_task(expression, difficulty)
    if len(tasks) == n:
        return list(tasks.values())
    raise TaskGenerationError(
        f"could only find {len(tasks)} of {n} distinct {split} tasks at difficulty {difficulty}"
    )


def _level(difficulty: int) -> tuple[tuple[int, int], tuple[str, ...]]:
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"unknown difficulty {difficulty!r}; expected one of {sorted(DIFFICULTIES)}")
    return DIFFICULTIES[difficulty]


def _hex(expression: str) -> str:
    return hashlib.sha256(f"{SUITE}:{expression}".encode()).hexdigest()


def _digest(expression: str) -> int:
    return int(_hex(expression)[:16], 16)
