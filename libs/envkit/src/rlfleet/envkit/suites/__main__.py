"""Writes a built-in suite split as JSONL: ``python -m rlfleet.envkit.suites calc train 1000 out.jsonl``."""

from __future__ import annotations

import argparse

from rlfleet.envkit.suite_format import write_suite
from rlfleet.envkit.suites import SUITE_NAMES, generate_tasks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlfleet.envkit.suites", description=__doc__)
    parser.add_argument("suite", choices=SUITE_NAMES)
    parser.add_argument("split", choices=("train", "heldout", "regression"))
    parser.add_argument("n", type=int, help="number of tasks")
    parser.add_argument("out", help="JSONL file to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--difficulty", type=int, default=1)
    args = parser.parse_args(argv)
    count = write_suite(generate_tasks(args.suite, args.split, args.n, args.seed, args.difficulty), args.out)
    print(f"wrote {count} {args.suite}/{args.split} tasks to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
