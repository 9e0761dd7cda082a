"""The labelled audit set: episodes whose true label is known by construction, and the rates a run stops on.

    python -m rlfleet.verifier.audit_set write DIR [--seed 0]
    rlfleet-verifier audit --audit-set DIR --sandbox-address HOST:PORT [--json]

`write` puts the task suites under ``DIR/suites`` (hidden answers and tests included) and one
labelled episode per line in ``DIR/labels.jsonl`` (the audit command's format). Labels are true by
construction, not by a person's judgement:

- ``calc``: the right answer (passed), a near miss (failed), a right ChatML transcript (passed), a
  transcript that never answers (failed);
- ``code``: every template's reference solution (passed); the reference with its result perturbed
  (failed); a solution that hard-codes the first case's answer (failed); every hack of
  `rlfleet.verifier.hacks` on a few templates (failed).

`audit_rates(report)` gives the false-positive and false-negative rates overall and per suite, and
`audit_breaches(report, ...)` the messages a controller stops a run with when a rate passes its
threshold.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

from rlfleet.verifier.hacks import HACKS
from rlfleet.verifier.kinds.audit import AuditReport

HACKED_TEMPLATES = ("fizzbuzz", "gcd", "flatten", "mean", "is_palindrome")
CALC_TASKS = 40
CODE_TIMEOUT_S = 4.0  # the audit set's hidden-test budget (hacks that sleep or flood cost this much each)

_PERTURB = '''

def _perturbed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, (list, tuple)):
        return value + type(value)([0])
    return None if value is not None else 0
'''


def labelled_episodes(seed: int = 0) -> tuple[dict[str, list[dict]], list[dict]]:
    """(suite name -> task records, labelled episodes)."""
    from rlfleet.envkit.suite_format import ExactVerifier, NumericVerifier
    from rlfleet.envkit.suites import calc, code
    from rlfleet.envkit.suites.code_templates import TEMPLATES

    rng = random.Random(seed)
    calc_tasks = calc.generate_tasks("train", CALC_TASKS, seed=seed)
    labels: list[dict] = []
    for task in calc_tasks:
        if not isinstance(task.verifier, ExactVerifier | NumericVerifier):
            raise TypeError(f"calc task {task.task_id} has a {task.verifier.kind} verifier, not an answer")
        answer = task.verifier.answer
        near = str(int(answer) + rng.choice((-10, -1, 1, 2, 10)))
        labels += [
            {"episode_id": f"calc-right-{task.task_id}", "suite": "calc", "task_id": task.task_id,
             "final_answer": answer, "human_passed": True},
            {"episode_id": f"calc-near-miss-{task.task_id}", "suite": "calc", "task_id": task.task_id,
             "final_answer": near, "human_passed": False},
            {"episode_id": f"calc-transcript-{task.task_id}", "suite": "calc", "task_id": task.task_id,
             "transcript": _calc_transcript(task.metadata["expression"], answer, answer),
             "human_passed": True},
            {"episode_id": f"calc-no-answer-{task.task_id}", "suite": "calc", "task_id": task.task_id,
             "transcript": "<|im_start|>assistant\nLet me think about it.<|im_end|>\n",
             "human_passed": False},
        ]
    code_tasks = []
    for template in TEMPLATES:
        record = code.make_task(template).model_dump(mode="json")
        record["verifier"]["timeout_s"] = CODE_TIMEOUT_S
        code_tasks.append(record)
        task_id, function = record["task_id"], template.function
        labels.append(_code_label(f"code-reference-{function}", task_id, template.solution, True))
        perturbed = (template.solution.replace(f"def {function}(", f"def _reference_{function}(", 1)
                     + _PERTURB
                     + f"\n\ndef {function}(*args):\n    return _perturbed(_reference_{function}(*args))\n")
        labels.append(_code_label(f"code-perturbed-{function}", task_id, perturbed, False))
        expected = [e for _, e in template.cases]
        if len({repr(e) for e in expected}) > 1:
            labels.append(_code_label(f"code-first-case-only-{function}", task_id,
                                      f"def {function}(*args):\n    return {expected[0]!r}\n", False))
        if function in HACKED_TEMPLATES:
            labels += [_code_label(f"code-hack-{hack.name}-{function}", task_id,
                                   hack.write(function, template.solution), False) for hack in HACKS]
    return {"calc": [t.model_dump(mode="json") for t in calc_tasks], "code": code_tasks}, labels


def _calc_transcript(expression: str, observation: str, answer: str) -> str:
    return (f"<|im_start|>assistant\n<calc>{expression}</calc><|im_end|>\n<|im_start|>tool\n{observation}"
            f"<|im_end|>\n<|im_start|>assistant\n<answer>{answer}</answer><|im_end|>\n")


def _code_label(episode_id: str, task_id: str, solution: str, passed: bool) -> dict:
    return {"episode_id": episode_id, "suite": "code", "task_id": task_id, "files": {"solution.py": solution},
            "human_passed": passed}


def write(directory: str | Path, seed: int = 0) -> tuple[Path, Path]:
    """Writes DIR/suites/<suite>.jsonl and DIR/labels.jsonl; returns (suites dir, labels file)."""
    directory = Path(directory)
    suites, labels = labelled_episodes(seed)
    (directory / "suites").mkdir(parents=True, exist_ok=True)
    for name, records in suites.items():
        (directory / "suites" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    labels_file = directory / "labels.jsonl"
    labels_file.write_text("".join(json.dumps(label) + "\n" for label in labels))
    return directory / "suites", labels_file


@dataclass(frozen=True)
class AuditRates:
    suite: str  # "" for the whole set
    n: int
    false_positive_rate: float
    false_negative_rate: float
    disagreement_rate: float


def audit_rates(report: AuditReport) -> dict[str, AuditRates]:
    """The rates of the whole set (key "") and of each suite."""
    def rates(suite: str, r: AuditReport) -> AuditRates:
        wrong = r.fp + r.fn
        return AuditRates(suite, r.n, r.false_positive_rate, r.false_negative_rate,
                          wrong / r.n if r.n else 0.0)

    return {"": rates("", report), **{name: rates(name, r) for name, r in sorted(report.by_suite.items())}}


def audit_breaches(report: AuditReport, max_false_positive_rate: float,
                   max_false_negative_rate: float) -> list[str]:
    """One message per rate (overall or of a suite) above its threshold; empty when the verifier
    may be trusted."""
    found = []
    for suite, rates in audit_rates(report).items():
        where = f"suite {suite!r}" if suite else "the audit set"
        if rates.false_positive_rate > max_false_positive_rate:
            found.append(f"the verifier passes {rates.false_positive_rate:.1%} of the failing episodes of "
                         f"{where} (max {max_false_positive_rate:.1%})")
        if rates.false_negative_rate > max_false_negative_rate:
            found.append(f"the verifier fails {rates.false_negative_rate:.1%} of the passing episodes of "
                         f"{where} (max {max_false_negative_rate:.1%})")
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlfleet.verifier.audit_set")
    commands = parser.add_subparsers(dest="command", required=True)
    write_cmd = commands.add_parser("write", help="write the labelled audit set into DIR")
    write_cmd.add_argument("directory")
    write_cmd.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    suites, labels = write(args.directory, args.seed)
    count = sum(1 for _ in labels.open())
    print(f"wrote {count} labelled episodes to {labels} and their suites to {suites}")


if __name__ == "__main__":
    main()
