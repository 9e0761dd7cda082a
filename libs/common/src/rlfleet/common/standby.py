"""A standby: a service process that has paid for its imports and waits to be promoted.

A restarted service spends much of its time before it serves again importing (the controller its
whole RL loop, the trainer torch and transformers), CPU work that depends on nothing the dead
process left. A supervisor (the local launcher, `restart.standby`) keeps a `<script> --standby`
beside the live process; the standby does that work, says so in `<ready_file>.standby` (its pid)
and blocks. When the live process dies, the supervisor sends the standby PROMOTE and it goes on as
an ordinary start: it reads its config only then (the ports the dead process bound were pinned
into its config file after the standby started), connects, binds and serves. A standby touches no
port, stream, store or state, so it never competes with the live process, and a promotion is the
same restart as a cold one, only sooner.

A standby whose parent (the supervisor) is gone exits, so an orphan never lingers. Stdlib only:
imported before anything else a service needs.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

FLAG = "--standby"
PROMOTE = signal.SIGUSR1
_POLL_S = 1.0


def requested(argv: list[str]) -> bool:
    return FLAG in argv


def strip_flag(argv: list[str]) -> list[str]:
    return [a for a in argv if a != FLAG]


def marker(ready_file: str | Path) -> Path:
    """Where a standby says it waits (JSON with its pid), beside its service's ready file."""
    return Path(f"{ready_file}.standby")


def hold() -> None:
    """Holds PROMOTE from now on, to be collected by `wait_for_promotion`. Called before the
    imports start threads (which inherit the mask), so that a PROMOTE sent meanwhile waits instead
    of ending the process (its default action)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {PROMOTE})


def wait_for_promotion(ready_file: str, warm_up: Callable[[], None]) -> float:
    """`warm_up()`, then blocks until PROMOTE; returns the promotion's perf_counter. Exits 0 when
    the parent goes away first."""
    hold()
    parent = os.getppid()
    if parent == 1:
        raise SystemExit(0)  # orphaned before it began: nobody would promote it
    warm_up()
    waiting = marker(ready_file) if ready_file else None
    if waiting is not None:
        tmp = waiting.with_name(waiting.name + ".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid()}))
        tmp.rename(waiting)
    print(f"standby (pid {os.getpid()}): imports done, waiting for {PROMOTE.name}", flush=True)
    try:
        while signal.sigtimedwait({PROMOTE}, _POLL_S) is None:
            if os.getppid() != parent:
                raise SystemExit(0)
    finally:
        if waiting is not None:
            waiting.unlink(missing_ok=True)
    promoted = time.perf_counter()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {PROMOTE})
    return promoted


def waiting_pid(ready_file: str | Path) -> int | None:
    """The pid of the standby waiting beside `ready_file`, or None."""
    try:
        return int(json.loads(marker(ready_file).read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
