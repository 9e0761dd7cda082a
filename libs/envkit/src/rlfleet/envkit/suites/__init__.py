"""The built-in task suites, by name.

Each suite module offers ``generate_tasks(split, n, seed=0, difficulty=1) -> list[Task]``,
deterministic in its arguments, with disjoint splits.
"""

from __future__ import annotations

from rlfleet.envkit.suite_format import Task

SUITE_NAMES = ("calc", "code", "repo")


def generate_tasks(suite: str, split: str, n: int, seed: int = 0, difficulty: int = 1) -> list[Task]:
    """Tasks of a built-in suite; imports the suite module only when it is asked for."""
    if suite == "calc":
        from rlfleet.envkit.suites import calc

        return calc.generate_tasks(split, n, seed=seed, difficulty=difficulty)
    if suite == "code":
        from rlfleet.envkit.suites import code

        return code.generate_tasks(split, n, seed=seed, difficulty=difficulty)
    if suite == "repo":
        from rlfleet.envkit.suites import repo

        return repo.generate_tasks(split, n, seed=seed, difficulty=difficulty)
    raise ValueError(f"unknown suite {suite!r}; built-in suites: {', '.join(SUITE_NAMES)}")
