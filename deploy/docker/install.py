#!/usr/bin/env python3
"""Installs rlfleet packages into an image's virtual environment, in two cacheable steps.

    install.py deps  --constraint requirements/lock.txt [--forbid torch] [--extra PKG]... DIR...
    install.py local DIR...
    install.py check [--forbid torch]

`deps` reads only the `pyproject.toml` of each package directory given (so a Dockerfile can copy
those first and keep this layer cached across source edits), follows the dependencies between
our own packages (`rlfleet-*`), and pip-installs every third-party requirement pinned by the
constraints file (requirements/lock.txt). An rlfleet package that a given one depends on but
that is not among DIR... is an error: the image would be missing it. `--forbid NAME` fails when
NAME is in the dependency closure (light services must never pull torch).

`local` installs the package directories themselves, without dependencies (they are in place
already) and without build isolation (setuptools is in the venv), then runs `pip check`.

`check` fails when a forbidden distribution is installed after all.

Standard library only: it runs before anything else is installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

LOCAL_PREFIX = "rlfleet-"
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def normalize(name: str) -> str:
    """PEP 503 name: lower case, runs of -_. become one dash."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    match = _NAME.match(requirement)
    if match is None:
        raise ValueError(f"cannot read a package name from requirement {requirement!r}")
    return normalize(match.group(1))


def read_project(directory: Path) -> tuple[str, list[str]]:
    """(normalized name, dependency strings) of the package in `directory`."""
    pyproject = directory / "pyproject.toml"
    if not pyproject.exists():
        raise SystemExit(f"install.py: {pyproject} does not exist")
    project = tomllib.loads(pyproject.read_text())["project"]
    return normalize(project["name"]), list(project.get("dependencies", []))


def third_party_requirements(directories: list[Path]) -> list[str]:
    """Every third-party requirement of the given local packages, checking local ones are all given."""
    projects = dict(read_project(d) for d in directories)
    requirements: dict[str, str] = {}
    for name, dependencies in projects.items():
        for requirement in dependencies:
            dep = requirement_name(requirement)
            if dep.startswith(LOCAL_PREFIX):
                if dep not in projects:
                    raise SystemExit(f"install.py: {name} depends on {dep}, which is not among the "
                                     f"package directories given ({', '.join(sorted(projects))})")
                continue
            # Keep every specifier: two packages may constrain the same dependency differently.
            requirements[requirement] = dep
    return sorted(requirements, key=lambda r: (requirements[r], r))


def closure_names(directories: list[Path]) -> set[str]:
    """Normalized names of every distribution the packages declare (local and third party)."""
    names = {read_project(d)[0] for d in directories}
    return names | {requirement_name(r) for r in third_party_requirements(directories)}


def pip(*args: str) -> None:
    command = [sys.executable, "-m", "pip", "install", "--no-cache-dir", "--disable-pip-version-check",
               "--no-input", *args]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True)


def cmd_deps(args: argparse.Namespace) -> None:
    directories = [Path(d) for d in args.dirs]
    requirements = third_party_requirements(directories) + list(args.extra)
    names = {requirement_name(r) for r in requirements}
    forbidden = sorted(names & {normalize(f) for f in args.forbid})
    if forbidden:
        raise SystemExit(f"install.py: {', '.join(forbidden)} would be installed, and is forbidden here")
    pip("--constraint", args.constraint, *requirements)


def cmd_local(args: argparse.Namespace) -> None:
    pip("--no-deps", "--no-build-isolation", *args.dirs)
    subprocess.run([sys.executable, "-m", "pip", "check", "--disable-pip-version-check"], check=True)


def cmd_check(args: argparse.Namespace) -> None:
    installed = {normalize(d.metadata["Name"]) for d in importlib.metadata.distributions()}
    present = sorted(installed & {normalize(f) for f in args.forbid})
    if present:
        raise SystemExit(f"install.py: forbidden distributions are installed: {', '.join(present)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="install.py", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    deps = commands.add_parser("deps", help="third-party dependencies, pinned by the constraints file")
    deps.add_argument("--constraint", required=True, help="pip constraints file (requirements/lock.txt)")
    deps.add_argument("--forbid", action="append", default=[], help="distribution that must not be pulled in")
    deps.add_argument("--extra", action="append", default=[], help="another requirement to install")
    deps.add_argument("dirs", nargs="+", help="package directories (each with a pyproject.toml)")
    local = commands.add_parser("local", help="our packages, without dependencies")
    local.add_argument("dirs", nargs="+")
    check = commands.add_parser("check", help="fail when a forbidden distribution is installed")
    check.add_argument("--forbid", action="append", default=[])
    args = parser.parse_args(argv)
    {"deps": cmd_deps, "local": cmd_local, "check": cmd_check}[args.command](args)


if __name__ == "__main__":
    main()
