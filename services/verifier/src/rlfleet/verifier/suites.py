"""The task suites the verifier scores against: every ``*.jsonl`` under ``suites_dir``, hidden fields
included.

Files are parsed with the suite format's own validation (``rlfleet.envkit.suite_format``); a file
with a bad line, a task whose verifier kind this verifier has not configured, or a (suite, task_id)
another file already defines is **rejected whole**, with the file and line in the log and in the
NOT_FOUND answer for its tasks, while the other suites keep serving. A lookup that misses rescans
the directory (only files whose size or mtime changed are parsed again), so suites written after
start-up are picked up without a restart.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfleet.common.errors import NotFound
from rlfleet.envkit.errors import SuiteFormatError
from rlfleet.envkit.suite_format import parse_task_line

log = logging.getLogger(__name__)


class TaskNotFound(NotFound):
    def __init__(self, suite: str, task_id: str, why: str) -> None:
        where = f"suite {suite!r}" if suite else "any suite"
        super().__init__(f"task {task_id!r} is not in {where}{why}", suite=suite, task_id=task_id)


@dataclass
class SuiteFile:
    stamp: tuple[int, int]  # (mtime_ns, size) when parsed
    tasks: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""  # why the file is rejected


class SuiteCatalog:
    def __init__(self, directory: str | Path, kinds: Collection[str]) -> None:
        self.directory = Path(directory)
        self.kinds = sorted(kinds)
        self.files: dict[Path, SuiteFile] = {}
        self.tasks: dict[tuple[str, str], dict[str, Any]] = {}
        self.by_id: dict[str, list[dict[str, Any]]] = {}
        self.clashes: dict[Path, str] = {}  # files rejected because another file defines one of their tasks
        self._lock = asyncio.Lock()

    @property
    def rejected(self) -> dict[str, str]:
        errors = {str(path): f.error for path, f in self.files.items() if f.error}
        return errors | {str(path): why for path, why in self.clashes.items()}

    @property
    def suites(self) -> set[str]:
        return {suite for suite, _ in self.tasks}

    async def task(self, suite: str, task_id: str) -> dict[str, Any]:
        """The full suite record of a task; rescans the directory once when it is not known yet."""
        found = self._find(suite, task_id)
        if found is None:
            async with self._lock:
                await asyncio.to_thread(self.refresh)
            found = self._find(suite, task_id)
        if found is None:
            raise TaskNotFound(suite, task_id, self._why_missing(suite))
        return found

    def refresh(self) -> bool:
        """Re-reads changed or new files and forgets deleted ones; True when anything changed."""
        seen = sorted(self.directory.rglob("*.jsonl")) if self.directory.is_dir() else []
        changed = set(self.files) - set(seen)
        for path in changed:
            del self.files[path]
        for path in seen:
            try:
                stat = path.stat()
            except OSError:
                continue
            stamp = (stat.st_mtime_ns, stat.st_size)
            if path not in self.files or self.files[path].stamp != stamp:
                self.files[path] = self._parse(path, stamp)
                changed.add(path)
        if changed:
            self._reindex()
        return bool(changed)

    def _parse(self, path: Path, stamp: tuple[int, int]) -> SuiteFile:
        parsed = SuiteFile(stamp)
        first_line: dict[str, int] = {}
        try:
            with open(path, encoding="utf-8") as lines:
                for number, text in enumerate(lines, start=1):
                    if not text.strip():
                        continue
                    task = parse_task_line(text, number, str(path))
                    if task.task_id in first_line:
                        raise SuiteFormatError(number, f"duplicate task_id {task.task_id!r} "
                                                       f"(first on line {first_line[task.task_id]})",
                                               str(path))
                    if task.verifier.kind not in self.kinds:
                        raise SuiteFormatError(number, "verifier.kind: no verifier kind "
                                                       f"{task.verifier.kind!r} is configured (configured: "
                                                       f"{', '.join(self.kinds)})", str(path))
                    first_line[task.task_id] = number
                    parsed.tasks.append(task.model_dump(mode="json"))
        except (SuiteFormatError, OSError, UnicodeDecodeError) as exc:
            parsed.tasks, parsed.error = [], str(exc)
            log.error("suite file rejected: %s", exc, extra={"path": str(path)})
        return parsed

    def _reindex(self) -> None:
        tasks: dict[tuple[str, str], dict[str, Any]] = {}
        origin: dict[tuple[str, str], Path] = {}
        self.clashes = {}
        for path, parsed in sorted(self.files.items()):
            keys = [(t["suite"], t["task_id"]) for t in parsed.tasks]
            clash = next((k for k in keys if k in tasks), None)
            if clash is not None:
                self.clashes[path] = (f"{path}: task {clash[1]!r} of suite {clash[0]!r} is already "
                                      f"defined in {origin[clash]}")
                log.error("suite file rejected: %s", self.clashes[path])
                continue
            for k, task in zip(keys, parsed.tasks, strict=True):
                tasks[k], origin[k] = task, path
        self.tasks = tasks
        self.by_id = {}
        for (_, task_id), task in tasks.items():
            self.by_id.setdefault(task_id, []).append(task)
        log.info("suites loaded", extra={"suites": sorted({s for s, _ in tasks}), "tasks": len(tasks),
                                         "rejected_files": len(self.rejected)})

    def _find(self, suite: str, task_id: str) -> dict[str, Any] | None:
        if suite:
            return self.tasks.get((suite, task_id))
        matches = self.by_id.get(task_id, [])
        return matches[0] if len(matches) == 1 else None

    def _why_missing(self, suite: str) -> str:
        why = ""
        if suite and suite not in self.suites:
            why = (f" (no suite {suite!r} is loaded from {self.directory}; "
                   f"loaded: {', '.join(sorted(self.suites)) or 'none'})")
        elif not suite:
            why = " (or it is in several suites: name the suite)"
        if self.rejected:
            why += "; rejected suite files: " + "; ".join(self.rejected.values())
        return why
