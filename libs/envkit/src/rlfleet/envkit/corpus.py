"""The text the default byte-level BPE tokenizer is trained on.

Mostly ChatML-rendered ``calc`` dialogues, ideal and flawed, at every difficulty, so the merges fit
what the tiny model actually reads and writes (system prompt, ``<calc>`` / ``<answer>`` tags,
numbers, tool results and error observations). Code-suite dialogues and one line of printable ASCII
follow, so no character a task can produce is left to raw byte fallback.
"""

from __future__ import annotations

import argparse
import string
from pathlib import Path

from rlfleet.common.chat import render_messages
from rlfleet.envkit.actions import parse_action, too_many_calls_error
from rlfleet.envkit.demos import generate_demos
from rlfleet.envkit.suites import calc, code

IMPERFECTIONS = (0.0, 0.5, 1.0)
# Inputs that make the calculator answer with each of its error lines.
BAD_EXPRESSIONS = (
    "1/0",
    "7%0",
    "2**10",
    "abs(3)",
    "(1+2",
    "1+",
    "",
    "((((" * 9 + "1",
    "9" * 61,
    "x.y",
    "3 4",
)
BAD_CALLS = ("<calc>1+2", "1+2</calc>", "<calculator>1+2</calculator>", "<python>1+2</python>")
DEFAULT_N = 2000


def default_corpus(seed: int = 0, n: int = DEFAULT_N, suite: str = "calc") -> list[str]:
    """About ``n`` rendered calc dialogues plus the error, code and alphabet texts; deterministic.
    ``suite="repo"``: the repo suite's dialogues instead (its model reads and writes code, not sums)."""
    if suite == "repo":
        return repo_corpus(seed, n)
    if suite != "calc":
        raise ValueError(f"no default tokenizer corpus for suite {suite!r}; expected calc or repo")
    texts = []
    buckets = [(d, p) for d in sorted(calc.DIFFICULTIES) for p in IMPERFECTIONS]
    for index, (difficulty, imperfection) in enumerate(buckets):
        count = n // len(buckets) + (1 if index < n % len(buckets) else 0)
        for demo in generate_demos(count, seed=seed, imperfection=imperfection, difficulty=difficulty):
            texts.append(render_messages(demo["messages"], add_generation_prompt=False))
    texts.extend(_error_dialogues())
    texts.extend(_code_dialogues())
    texts.append(string.printable)
    return texts


def _calc_prompt(expression: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": calc.SYSTEM_PROMPT},
        {"role": "user", "content": calc.prompt_of(expression)},
    ]


def _error_dialogues() -> list[str]:
    texts = []
    for expression in BAD_EXPRESSIONS:
        turns = [
            {"role": "assistant", "content": f"<calc>{expression}</calc>"},
            {"role": "tool", "content": calc.tool_observation(expression)},
        ]
        texts.append(render_messages(_calc_prompt("12+34") + turns, add_generation_prompt=False))
    for call in BAD_CALLS:
        error = parse_action(call, [calc.TOOL.name]).error  # type: ignore[union-attr]
        turns = [{"role": "assistant", "content": call}, {"role": "tool", "content": error}]
        texts.append(render_messages(_calc_prompt("1+2") + turns, add_generation_prompt=False))
    limit = [
        {"role": "assistant", "content": "<calc>1+2</calc>"},
        {"role": "tool", "content": too_many_calls_error(calc.LIMITS.max_turns)},
    ]
    texts.append(render_messages(_calc_prompt("1+2") + limit, add_generation_prompt=False))
    return texts


def _code_dialogues() -> list[str]:
    # Train tasks only: heldout solutions stay out of everything a model is fit to, merges included.
    texts = []
    for task in code.generate_tasks("train"):
        turns = [
            {
                "role": "assistant",
                "content": f"<write_file>{code.SOLUTION_FILE}\n{code.reference_solution(task)}</write_file>",
            },
            {"role": "tool", "content": f"wrote {code.SOLUTION_FILE}"},
            {"role": "assistant", "content": "<answer>done</answer>"},
        ]
        texts.append(render_messages(task.chat_messages() + turns, add_generation_prompt=False))
    return texts


def repo_corpus(seed: int = 0, n: int = DEFAULT_N) -> list[str]:
    """Rendered repo demonstrations (train tasks only), ideal and flawed, at every level, the suite's
    error observations, and one line of printable ASCII."""
    from rlfleet.envkit import repo_demos
    from rlfleet.envkit.suites import repo

    texts = []
    buckets = [(level, p) for level in repo.LEVELS for p in IMPERFECTIONS]
    for index, (level, imperfection) in enumerate(buckets):
        count = n // len(buckets) + (1 if index < n % len(buckets) else 0)
        for demo in repo_demos.generate_demos(count, seed=seed, imperfection=imperfection, difficulty=level):
            texts.append(render_messages(demo["messages"], add_generation_prompt=False))
    prompt = [{"role": "user", "content": "Fix it."}]
    for call in ("<run>python3 x.py", "<python>1</python>", "<edit_file>a.py\nx</edit_file>",
                 "<read_file>a.py</run>"):
        action = parse_action(call, repo.TOOL_NAMES)
        error = action.error if hasattr(action, "error") else \
            "error: edit_file needs the old text, a line ---, then the new text"
        texts.append(render_messages([*prompt, {"role": "assistant", "content": call},
                                      {"role": "tool", "content": error}], add_generation_prompt=False))
    texts.append(render_messages([*prompt, {"role": "assistant", "content": "<run>ls</run>"},
                                  {"role": "tool", "content": too_many_calls_error(4)}],
                                 add_generation_prompt=False))
    texts.append(string.printable)
    return texts


def write_corpus(path: Path, texts: list[str]) -> Path:
    """One text per line, newlines written as a literal backslash-n: what `rlfleet-build-model
    --corpus` reads."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(t.replace("\n", "\\n") + "\n" for t in texts), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m rlfleet.envkit.corpus",
        description="Writes the default tokenizer corpus for rlfleet-build-model --corpus.")
    parser.add_argument("--out", type=Path, required=True, help="file to write")
    parser.add_argument("--seed", type=int, default=0, help="seed of the dialogues")
    parser.add_argument("--n", type=int, default=DEFAULT_N, help="about this many dialogues")
    parser.add_argument("--suite", choices=("calc", "repo"), default="calc", help="whose dialogues")
    args = parser.parse_args(argv)
    write_corpus(args.out, default_corpus(args.seed, args.n, args.suite))


if __name__ == "__main__":
    main()
