"""Demonstrations of the ``calc`` suite for the supervised warm start, deliberately imperfect.

``imperfection`` is the probability that a demonstration carries one of the flaws below instead
of being the ideal episode. The flaws are behaviours a real agent shows, so a model warm-started on
them learns the format but sometimes skips the tool or garbles a copy. Its held-out success then
sits clearly below 100%, and an RL run with the verifier has something to gain by preferring the
behaviour that succeeds.

Flaw (share of the flawed demos)   what the demo does                             final answer
- ``no_tool`` (40%)                answers "mentally" without calling the tool     wrong 75% of the time
- ``wrong_expression`` (30%)       calls the tool with a transcription error       always wrong
- ``malformed_call`` (15%)         a broken or misnamed tag, gets the error back,  right half the time
                                   then retries properly or guesses
- ``answer_typo`` (15%)            right tool call, garbles the result it copies   always wrong

So at imperfection ``p`` about ``1 - 0.8 p`` of the demos end with the right answer (0.6 at the
default 0.5); a tiny model imitating them lands lower still, which is the point. Every record names
its flaw (``"none"`` for the ideal episode) so analyses can split by it; trainers read only
``messages``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from rlfleet.envkit.actions import InvalidCall, parse_action
from rlfleet.envkit.suites import calc

FLAWS: dict[str, float] = {
    "no_tool": 0.40,
    "wrong_expression": 0.30,
    "malformed_call": 0.15,
    "answer_typo": 0.15,
}
MENTAL_ARITHMETIC_RIGHT = 0.25  # a "mental" answer is right this often
MALFORMED_RETRY = 0.5  # after a malformed call, the demo retries properly this often (else it guesses)
DEFAULT_IMPERFECTION = 0.5


def generate_demos(
    n: int, seed: int = 0, imperfection: float = DEFAULT_IMPERFECTION, difficulty: int = 1
) -> list[dict[str, Any]]:
    """``n`` JSONL-ready records ``{"messages", "task_id", "flaw"}`` from distinct train tasks."""
    if not 0.0 <= imperfection <= 1.0:
        raise ValueError(f"imperfection must be in [0, 1], got {imperfection}")
    rng = random.Random(f"demos:{seed}:{imperfection}:{difficulty}")
    tasks = calc.generate_tasks("train", n, seed=seed, difficulty=difficulty)
    demos = []
    for task in tasks:
        flaw = (
            rng.choices(list(FLAWS), weights=list(FLAWS.values()))[0]
            if rng.random() < imperfection
            else "none"
        )
        prompt = task.chat_messages()
        turns = _TURNS[flaw](task.metadata["expression"], rng)
        demos.append({"messages": prompt + turns, "task_id": task.task_id, "flaw": flaw})
    return demos


def write_demos(demos: list[dict[str, Any]], path: str | Path) -> int:
    """Writes demonstration records as JSONL (parent folders created); returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as out:
        out.writelines(json.dumps(demo, ensure_ascii=False) + "\n" for demo in demos)
    return len(demos)


def _assistant(content: str) -> dict[str, str]:
    return {"role": "assistant", "content": content}


def _tool(content: str) -> dict[str, str]:
    return {"role": "tool", "content": content}


def _ideal(expression: str) -> list[dict[str, str]]:
    result = calc.tool_observation(expression)
    return [_assistant(f"<calc>{expression}</calc>"), _tool(result), _assistant(f"<answer>{result}</answer>")]


def _no_tool(expression: str, rng: random.Random) -> list[dict[str, str]]:
    return [_assistant(f"<answer>{mental_answer(expression, rng)}</answer>")]


def _wrong_expression(expression: str, rng: random.Random) -> list[dict[str, str]]:
    return _ideal(transcription_error(expression, rng))


def _malformed_call(expression: str, rng: random.Random) -> list[dict[str, str]]:
    call = rng.choice(
        (
            f"<calc>{expression}",
            f"<calc>{expression}</answer>",
            f"<calculator>{expression}</calculator>",
            f"{expression}</calc>",
        )
    )
    action = parse_action(call, [calc.TOOL.name])
    if not isinstance(action, InvalidCall):  # the observation must be exactly what a worker would send
        raise RuntimeError(f"{call!r} was meant to be an invalid call, parsed as {action}")
    turns = [_assistant(call), _tool(action.error)]
    if rng.random() < MALFORMED_RETRY:
        return turns + _ideal(expression)
    return turns + _no_tool(expression, rng)


def _answer_typo(expression: str, rng: random.Random) -> list[dict[str, str]]:
    result = calc.tool_observation(expression)
    typo = garble_number(result, rng)
    return [_assistant(f"<calc>{expression}</calc>"), _tool(result), _assistant(f"<answer>{typo}</answer>")]


_TURNS = {
    "none": lambda expression, rng: _ideal(expression),
    "no_tool": _no_tool,
    "wrong_expression": _wrong_expression,
    "malformed_call": _malformed_call,
    "answer_typo": _answer_typo,
}


def mental_answer(expression: str, rng: random.Random) -> str:
    """The right result sometimes, otherwise a plausible near miss."""
    result = calc.tool_observation(expression)
    return result if rng.random() < MENTAL_ARITHMETIC_RIGHT else garble_number(result, rng)


def garble_number(number: str, rng: random.Random) -> str:
    """A different integer a person could plausibly write: off by a little, two digits swapped,
    one digit changed."""
    value = int(number)
    digits = str(abs(value))
    choices = ["off_by_small", "change_digit"] + (["swap_digits"] if len(set(digits)) > 1 else [])
    how = rng.choice(choices)
    if how == "off_by_small":
        garbled = value + rng.choice((-1, 1)) * rng.randint(1, 10)
    elif how == "swap_digits":
        garbled = int(_swap_adjacent(digits, rng)) * (-1 if value < 0 else 1)
    else:
        garbled = int(_change_digit(digits, rng)) * (-1 if value < 0 else 1)
    return str(garbled) if garbled != value else str(value + 1)


def transcription_error(expression: str, rng: random.Random) -> str:
    """``expression`` with one operand miscopied, such that the result differs."""
    for _ in range(100):
        start, end = rng.choice(_operand_spans(expression))
        operand = expression[start:end]
        how = rng.choice(("change_digit", "swap_digits", "drop_digit"))
        if how == "swap_digits" and len(set(operand)) > 1:
            miscopied = _swap_adjacent(operand, rng)
        elif how == "drop_digit" and len(operand) > 1:
            k = rng.randrange(len(operand))
            miscopied = (operand[:k] + operand[k + 1 :]).lstrip("0") or "0"
        else:
            miscopied = _change_digit(operand, rng)
        candidate = expression[:start] + miscopied + expression[end:]
        if calc.tool_observation(candidate) != calc.tool_observation(expression):
            return candidate
    raise AssertionError(f"no transcription error of {expression!r} changes its value")


def _operand_spans(expression: str) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, ch in enumerate(expression + " "):
        if ch.isdigit() and start is None:
            start = i
        elif not ch.isdigit() and start is not None:
            spans.append((start, i))
            start = None
    return spans


def _swap_adjacent(digits: str, rng: random.Random) -> str:
    pairs = [k for k in range(len(digits) - 1) if digits[k] != digits[k + 1]]
    if not pairs:
        return _change_digit(digits, rng)
    k = rng.choice(pairs)
    swapped = digits[:k] + digits[k + 1] + digits[k] + digits[k + 2 :]
    return swapped.lstrip("0") or "0"


def _change_digit(digits: str, rng: random.Random) -> str:
    k = rng.randrange(len(digits))
    # Never a leading zero: the miscopy must still look like a number someone would write.
    options = [d for d in "0123456789" if d != digits[k] and not (k == 0 and d == "0" and len(digits) > 1)]
    return digits[:k] + rng.choice(options) + digits[k + 1 :]


def main(argv: list[str] | None = None) -> int:
    """``python -m rlfleet.envkit.demos 2000 demos.jsonl --imperfection 0.5``"""
    parser = argparse.ArgumentParser(
        prog="python -m rlfleet.envkit.demos", description="Writes calc demonstrations as JSONL."
    )
    parser.add_argument("n", type=int)
    parser.add_argument("out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--imperfection", type=float, default=DEFAULT_IMPERFECTION, help="share of flawed demos, 0..1"
    )
    parser.add_argument("--difficulty", type=int, default=1)
    args = parser.parse_args(argv)
    count = write_demos(generate_demos(args.n, args.seed, args.imperfection, args.difficulty), args.out)
    print(f"wrote {count} demonstrations (imperfection {args.imperfection}) to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
