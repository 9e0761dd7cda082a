"""Startup phase marks: where a (re)started trainer's time goes before it trains again.

Each mark is one log line, `startup phase <name>`, with `phase`, `perf_counter` (CLOCK_MONOTONIC on
Linux, so comparable with another process's clock: bench/trainer_restart.py measures from its
SIGKILL and spawn) and `since_entry_s` (from the console script's first line of its own).
Importable without torch.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)

_entry = time.perf_counter()
passed: set[str] = set()


def begin(at: float | None = None) -> None:
    """The console script's entry (what came before it is the interpreter and its first imports),
    or a standby's promotion `at`."""
    global _entry
    _entry = time.perf_counter() if at is None else at


def mark(phase: str) -> None:
    """Logs `phase` once per process (later calls are no-ops, so hot paths may call it)."""
    if phase in passed:
        return
    passed.add(phase)
    now = time.perf_counter()
    since = now - _entry
    log.info("startup phase %s: %.3f s after entry", phase, since,
             extra={"phase": phase, "perf_counter": round(now, 4), "since_entry_s": round(since, 4),
                    "entry_perf_counter": round(_entry, 4)})
