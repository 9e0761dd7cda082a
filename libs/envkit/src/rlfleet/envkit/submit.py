"""`rlfleet-submit`: put a suite's tasks in front of the rollout workers.

    rlfleet-submit calc --run-dir runs/local --split train --n 100 --group-size 4
    rlfleet-submit my-suite.jsonl --run-id R --nats-url nats://... --suites-dir runs/local/suites

1. Load the tasks: a built-in suite by name (`calc`, `code`; generated deterministically from
   split, n, seed, difficulty) or a suite JSONL file. A malformed line stops everything with its
   line number: nothing is written, nothing published.
2. Write the full records (answers, hidden tests) the verifier does not have yet into its suites
   directory, appended to `<suites_dir>/<suite>.jsonl`; a task any file there already defines is not
   repeated (the verifier rejects a file that does), and one defined with other content is an error.
3. Publish each task's public view as a `rlfleet.common.v1.Task` on the run's TASKS subject, with
   `Nats-Msg-Id = <run>/<task_id>/g<group_size>/e<epoch>`, so a re-submit within JetStream's
   duplicate window (2 minutes) adds nothing; `--epoch` submits the same tasks again on purpose.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import os
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from rlfleet.common.config import NatsConfig
from rlfleet.common.errors import StartupError
from rlfleet.common.infra_auth import run_dir_login
from rlfleet.common.streams import connect_nats, ensure_streams, publish
from rlfleet.envkit.errors import EnvkitError
from rlfleet.envkit.run_dir import RunDir
from rlfleet.envkit.sdk.environment import known_suites
from rlfleet.envkit.suite_format import Task, load_suite, task_to_line
from rlfleet.envkit.suites import SUITE_NAMES, generate_tasks
from rlfleet.envkit.tasks import TASK_TYPE, task_message

NAME = "rlfleet-submit"


class SubmitError(EnvkitError):
    """What stops a submission before anything is published; one line for the user."""


@dataclass
class SubmitReport:
    tasks: int = 0
    written: int = 0  # new to the verifier's suites directory
    published: int = 0
    duplicates: int = 0
    files: list[Path] = field(default_factory=list)


def load_tasks(source: str, split: str = "train", n: int = 100, seed: int = 0,
               difficulty: int = 1) -> list[Task]:
    """A built-in suite's tasks, or a suite file's (validated, line numbers in errors)."""
    path = Path(source)
    if source in SUITE_NAMES and not path.exists():
        try:
            return generate_tasks(source, split, n, seed=seed, difficulty=difficulty)
        except ValueError as exc:
            raise SubmitError(str(exc)) from None
    if not path.exists():
        raise SubmitError(f"{source!r} is neither a built-in suite ({', '.join(SUITE_NAMES)}) nor a file")
    try:
        tasks = load_suite(path)
    except (ValueError, UnicodeDecodeError) as exc:  # SuiteFormatError is a ValueError
        raise SubmitError(f"bad suite file: {exc}") from None
    if not tasks:
        raise SubmitError(f"{path} holds no tasks")
    return tasks


def check_suites(tasks: Iterable[Task], known: Iterable[str]) -> None:
    """Every task's suite must have an environment the workers can run."""
    known = set(known)
    unknown = sorted({task.suite for task in tasks} - known)
    if unknown:
        raise SubmitError(f"no environment for suite(s) {', '.join(map(repr, unknown))} (known: "
                          f"{', '.join(sorted(known))}); register one in your workers and pass "
                          "--allow-unknown-suites")


def write_for_verifier(tasks: list[Task], suites_dir: Path) -> tuple[list[Path], int]:
    """Adds the full records the verifier does not have yet to `<suites_dir>/<suite>.jsonl`.

    The verifier reads every `*.jsonl` under its directory and rejects a whole file that repeats a
    task another file defines, so a task already present anywhere there (same content) is not
    written again, and one present with other content is an error. Atomic, under a lock."""
    suites_dir.mkdir(parents=True, exist_ok=True)
    files = []
    with open(suites_dir / ".submit.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        known = _known_tasks(suites_dir)
        by_suite: dict[str, list[str]] = defaultdict(list)
        for task in tasks:
            line, where = task_to_line(task), known.get((task.suite, task.task_id))
            if where is None:
                by_suite[task.suite].append(line)
                known[(task.suite, task.task_id)] = (line, suites_dir / f"{task.suite}.jsonl")
            elif where[0] != line:
                raise SubmitError(f"task {task.task_id!r} of suite {task.suite!r} is already in {where[1]} "
                                  f"with different content; give it a new task_id")
        for suite, lines in by_suite.items():
            target = suites_dir / f"{suite}.jsonl"
            old = target.read_text(encoding="utf-8") if target.exists() else ""
            tmp = target.with_suffix(".jsonl.tmp")
            tmp.write_text(old + ("" if not old or old.endswith("\n") else "\n")
                           + "".join(x + "\n" for x in lines), encoding="utf-8")
            tmp.rename(target)
            files.append(target)
    return files, sum(len(lines) for lines in by_suite.values())


def _known_tasks(suites_dir: Path) -> dict[tuple[str, str], tuple[str, Path]]:
    """(suite, task_id) -> (normalized line, file) of every task the verifier can already read."""
    known: dict[tuple[str, str], tuple[str, Path]] = {}
    for path in sorted(suites_dir.rglob("*.jsonl")):
        try:
            for task in load_suite(path):
                known.setdefault((task.suite, task.task_id), (task_to_line(task), path))
        except (ValueError, OSError, UnicodeDecodeError) as exc:  # the verifier rejects that file itself
            print(f"{NAME}: warning: {exc}", file=sys.stderr)
    return known


async def publish_tasks(tasks: list[Task], run_id: str, nats_url: str, group_size: int, epoch: int = 0,
                        temperature: float | None = None,
                        login: dict[str, str] | None = None) -> tuple[int, int]:
    """Publishes the public views on TASKS; returns (published, duplicates). `login` is the NATS
    user's (`user`, `password` or `password_file`): only the operator user may publish tasks."""

    nc = await connect_nats(NatsConfig(url=nats_url, **(login or {})), NAME)
    try:
        js = nc.jetstream()
        await ensure_streams(js, ("TASKS",))
        published = duplicates = 0
        for task in tasks:
            message = task_message(task, run_id, group_size, temperature)
            fresh = await publish(js, "TASKS", run_id, message.SerializeToString(), msg_type=TASK_TYPE,
                                  msg_id=f"{run_id}/{task.task_id}/g{group_size}/e{epoch}")
            published += fresh
            duplicates += not fresh
        return published, duplicates
    finally:
        await nc.close()


def submit(tasks: list[Task], *, run_id: str, nats_url: str, suites_dir: Path, group_size: int,
           epoch: int = 0, temperature: float | None = None,
           login: dict[str, str] | None = None) -> SubmitReport:
    # the verifier must know a task before a worker runs it
    files, written = write_for_verifier(tasks, suites_dir)
    published, duplicates = asyncio.run(publish_tasks(tasks, run_id, nats_url, group_size, epoch, temperature,
                                                      login))
    return SubmitReport(len(tasks), written, published, duplicates, files)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=NAME, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", metavar="SUITE_OR_JSONL",
                   help=f"a built-in suite ({', '.join(SUITE_NAMES)}) or a suite file")
    p.add_argument("--run-dir",
                   help="a launched platform's run directory: fills --run-id, --nats-url, --suites-dir")
    p.add_argument("--run-id", help="run namespace of the TASKS subject")
    p.add_argument("--nats-url", help="NATS with JetStream")
    p.add_argument("--nats-user", default=os.environ.get("RLFLEET__NATS__USER", ""),
                   help="NATS user allowed to publish tasks (env RLFLEET__NATS__USER; --run-dir: operator)")
    p.add_argument("--nats-password-file", default=os.environ.get("RLFLEET__NATS__PASSWORD_FILE", ""),
                   help="file holding its password (env RLFLEET__NATS__PASSWORD_FILE, or the password itself "
                        "in RLFLEET__NATS__PASSWORD)")
    p.add_argument("--suites-dir", help="the verifier's suites directory")
    p.add_argument("--split", default="train", choices=("train", "heldout", "regression"),
                   help="built-in suites")
    p.add_argument("--n", type=int, default=100, help="tasks to generate (built-in suites)")
    p.add_argument("--seed", type=int, default=0, help="generation seed (built-in suites)")
    p.add_argument("--difficulty", type=int, default=1, help="calc difficulty 1-3 (built-in suites)")
    p.add_argument("--group-size", type=int, default=4, help="samples per task (G)")
    p.add_argument("--epoch", type=int, default=0, help="a new epoch publishes the same tasks again")
    p.add_argument("--temperature", type=float, help="sampling temperature (default: the workers')")
    p.add_argument("--allow-unknown-suites", action="store_true",
                   help="publish tasks of suites without a built-in environment (your workers register one)")
    p.add_argument("--dry-run", action="store_true", help="validate and print what would be submitted")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        raise SystemExit(_run(args))
    except (EnvkitError, OSError) as exc:
        print(f"{NAME}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _run(args: argparse.Namespace) -> int:
    if args.group_size < 1:
        raise SubmitError("--group-size must be at least 1")
    run_id, nats_url, suites_dir = args.run_id, args.nats_url, args.suites_dir
    login = {"user": args.nats_user, "password_file": args.nats_password_file,
             "password": os.environ.get("RLFLEET__NATS__PASSWORD", "")} if args.nats_user else {}
    if args.run_dir:
        launched = RunDir.load(args.run_dir)
        run_id, nats_url = run_id or launched.run_id, nats_url or launched.nats_url
        suites_dir = suites_dir or str(launched.suites_dir)
        login = login or run_dir_login(args.run_dir, "nats", "operator")
    tasks = load_tasks(args.source, args.split, args.n, args.seed, args.difficulty)
    if not args.allow_unknown_suites:
        check_suites(tasks, known_suites())
    if args.dry_run:
        print(f"{len(tasks)} valid tasks from {args.source} "
              f"(suites: {', '.join(sorted({t.suite for t in tasks}))})")
        return 0
    missing = [flag for flag, value in (("--run-id", run_id), ("--nats-url", nats_url),
                                        ("--suites-dir", suites_dir)) if not value]
    if missing:
        raise SubmitError(f"{', '.join(missing)} required (or --run-dir of a launched platform)")
    try:
        report = submit(tasks, run_id=run_id, nats_url=nats_url, suites_dir=Path(suites_dir),
                        group_size=args.group_size, epoch=args.epoch,
                        temperature=args.temperature, login=login)
    except StartupError as exc:
        raise SubmitError(str(exc)) from None
    where = ", ".join(map(str, report.files)) or "(all known already)"
    print(f"{report.tasks} tasks: {report.written} new in {suites_dir} {where}; published {report.published} "
          f"to rlfleet.{run_id}.tasks (group size {args.group_size})"
          + (f", {report.duplicates} already there" if report.duplicates else ""))
    return 0


if __name__ == "__main__":
    main()
