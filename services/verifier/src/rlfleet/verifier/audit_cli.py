"""`rlfleet-verifier audit` (also `rlfleet-verifier-audit`): how often the verifier agrees with labels,
offline.

    rlfleet-verifier audit --suite-dir runs/suites --labels labels.jsonl [--sandbox-address HOST:PORT]
                           [--json]
    rlfleet-verifier audit --audit-set DIR --sandbox-address HOST:PORT [--max-false-positive-rate 0.01]

`--audit-set DIR` is a directory written by `python -m rlfleet.verifier.audit_set write DIR`
(`DIR/suites`, `DIR/labels.jsonl`).

Each line of the labels file is one labelled episode (unknown keys are errors):

    {"episode_id": "e1", "suite": "calc", "task_id": "calc-1-...", "final_answer": "1781",
     "human_passed": true}
    {"episode_id": "e2", "suite": "code", "task_id": "code-fizzbuzz", "files": {"solution.py": "def ..."},
     "human_passed": false}
    {"episode_id": "e3", "task_id": "calc-1-...",
     "transcript": "<|im_start|>assistant\\n<answer>3</answer>...", "human_passed": false}

`transcript` is the assistant's text (a ChatML-rendered conversation or one turn); `unit_tests` tasks
need `--sandbox-address` (their hidden tests run in a fresh sandbox). Prints the confusion counts,
the false-positive and false-negative rates (overall and per suite) and every disagreement; exit 0,
2 with one line on bad input, 3 when a rate passes `--max-false-positive-rate` or
`--max-false-negative-rate`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rlfleet-verifier audit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--audit-set", default="",
                        help="directory of a labelled audit set (DIR/suites, DIR/labels.jsonl)")
    parser.add_argument("--suite-dir", default="",
                        help="directory of task suites (*.jsonl) with hidden fields")
    parser.add_argument("--labels", default="", help="JSONL of labelled episodes")
    parser.add_argument("--max-false-positive-rate", type=float, default=1.0, help="exit 3 above this rate")
    parser.add_argument("--max-false-negative-rate", type=float, default=1.0, help="exit 3 above this rate")
    parser.add_argument("--sandbox-address", default="",
                        help="sandbox manager for unit_tests tasks (host:port)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.audit_set:
        args.suite_dir = args.suite_dir or str(Path(args.audit_set) / "suites")
        args.labels = args.labels or str(Path(args.audit_set) / "labels.jsonl")
    if not (args.suite_dir and args.labels):
        parser.error("give --audit-set DIR, or --suite-dir and --labels")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not Path(args.suite_dir).is_dir():
        print(f"rlfleet-verifier-audit: --suite-dir {args.suite_dir} is not a directory", file=sys.stderr)
        raise SystemExit(2)
    from rlfleet.common.errors import RlfleetError

    try:
        report = asyncio.run(run_audit(args))
    except (RlfleetError, ValueError, OSError) as exc:
        print(f"rlfleet-verifier-audit: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(report_dict(report), indent=2) if args.json else format_report(report, args.suite_dir))
    from rlfleet.verifier.audit_set import audit_breaches

    breaches = audit_breaches(report, args.max_false_positive_rate, args.max_false_negative_rate)
    for breach in breaches:
        print(f"rlfleet-verifier audit: {breach}", file=sys.stderr)
    if breaches:
        raise SystemExit(3)


async def run_audit(args: argparse.Namespace):
    from rlfleet.verifier.app import build_verifier
    from rlfleet.verifier.config import VerifierConfig
    from rlfleet.verifier.kinds import KIND_NAMES

    config = VerifierConfig(suites_dir=args.suite_dir, sandbox_address=args.sandbox_address)
    logging.getLogger("rlfleet.verifier.suites").setLevel(logging.CRITICAL)  # rejections are reported below
    verifier = build_verifier(config, kinds=KIND_NAMES, sandbox_setting="--sandbox-address")
    try:
        await asyncio.to_thread(verifier.catalog.refresh)
        if verifier.catalog.rejected:
            raise ValueError("suite file rejected: " + "; ".join(verifier.catalog.rejected.values()))
        return await verifier.audit(read_labels(Path(args.labels)))
    finally:
        await verifier.sandboxes.close()


def read_labels(path: Path) -> list:
    from pydantic import ValidationError

    from rlfleet.common.config import StrictModel
    from rlfleet.verifier.verifier import LabelledInput

    class Label(StrictModel):
        episode_id: str = ""
        suite: str = ""
        task_id: str
        human_passed: bool
        final_answer: str = ""
        files: dict[str, str] = {}
        transcript: str = ""

    items = []
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not text.strip():
            continue
        try:
            label = Label.model_validate_json(text)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'line'}: {e['msg']}"
                                 for e in exc.errors())
            raise ValueError(f"{path}:{number}: {problems}") from None
        items.append(LabelledInput(suite=label.suite, task_id=label.task_id, human_passed=label.human_passed,
                                   final_answer=label.final_answer, files=label.files,
                                   transcript=label.transcript,
                                   episode_id=label.episode_id or f"line {number}"))
    return items


def report_dict(report) -> dict:
    return {"n": report.n, "true_positives": report.tp, "false_positives": report.fp,
            "true_negatives": report.tn, "false_negatives": report.fn,
            "false_positive_rate": report.false_positive_rate,
            "false_negative_rate": report.false_negative_rate,
            "suites": {name: {"n": r.n, "true_positives": r.tp, "false_positives": r.fp,
                              "true_negatives": r.tn, "false_negatives": r.fn,
                              "false_positive_rate": r.false_positive_rate,
                              "false_negative_rate": r.false_negative_rate}
                       for name, r in sorted(report.by_suite.items())},
            "disagreements": [{"episode_id": d.episode_id, "task_id": d.task_id,
                               "human_passed": d.human_passed, "verifier_passed": d.verifier_passed,
                               "reasons": [{"code": r.code.value, "message": r.message, "details": r.details}
                                           for r in d.reasons]}
                              for d in report.disagreements]}


def format_report(report, suite_dir: str) -> str:
    def verdict(passed: bool) -> str:
        return "passed" if passed else "failed"

    lines = [
        f"audit of {report.n} labelled episodes against the suites in {suite_dir}",
        f"{'':18}{'human passed':>14}{'human failed':>14}",
        f"{'verifier passed':18}{'TP ' + str(report.tp):>14}{'FP ' + str(report.fp):>14}",
        f"{'verifier failed':18}{'FN ' + str(report.fn):>14}{'TN ' + str(report.tn):>14}",
        f"false positive rate {report.false_positive_rate:.3f}  (FP / (FP + TN): "
        "rewarded what a human failed)",
        f"false negative rate {report.false_negative_rate:.3f}  (FN / (FN + TP): failed what a human passed)",
    ]
    for name, r in sorted(report.by_suite.items()):
        lines.append(f"  suite {name or '-'}: n {r.n}  TP {r.tp}  FP {r.fp}  TN {r.tn}  FN {r.fn}  "
                     f"false positive rate {r.false_positive_rate:.3f}  "
                     f"false negative rate {r.false_negative_rate:.3f}")
    lines.append(f"disagreements: {len(report.disagreements)}")
    for d in report.disagreements:
        why = "; ".join(f"{r.code.value}: {r.message}" for r in d.reasons) or "-"
        lines.append(f"  {d.episode_id}  {d.task_id}  human {verdict(d.human_passed)}, "
                     f"verifier {verdict(d.verifier_passed)}  ({why})")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
