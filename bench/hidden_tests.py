"""How long the verifier's supervised hidden-test run takes for correct code solutions, through a real
sandbox manager (one fresh sandbox per run, one worker process per candidate call). Prints figures;
it is not a pass/fail test. Needs root and bubblewrap, like the sandbox manager.

    .venv/bin/python bench/hidden_tests.py [--tasks 12]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from rlfleet.common.processes import start_redis
from rlfleet.common.testing import unique_run_id
from rlfleet.envkit.suites import code
from rlfleet.envkit.suites.code_templates import TEMPLATES
from rlfleet.sandbox.testing import start_sandbox_manager
from rlfleet.verifier.config import TestSandboxSection
from rlfleet.verifier.kinds import Episode, default_kinds
from rlfleet.verifier.peers import SandboxPeer


async def measure(address: str, n: int) -> list[float]:
    peer = SandboxPeer(address, "sandbox_address", 30.0, TestSandboxSection())
    loop = asyncio.get_running_loop()
    kinds = default_kinds(lambda r: asyncio.run_coroutine_threadsafe(peer.run_tests(r), loop).result())
    times = []
    try:
        for template in TEMPLATES[:n]:
            episode = Episode(assistant_texts=["<answer>done</answer>"],
                              files={"solution.py": template.solution})
            started = time.monotonic()
            verdict = await asyncio.to_thread(kinds.score, code.make_task(template), episode)
            times.append(time.monotonic() - started)
            assert verdict.passed, verdict
    finally:
        await peer.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=12)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-hidden-tests-"))
    redis = start_redis(work / "redis")
    manager = start_sandbox_manager(redis.url, unique_run_id("bench"), work)
    try:
        times = asyncio.run(measure(manager.address, args.tasks))
    finally:
        manager.stop()
        redis.stop(10)
    cases = [len(t.cases) for t in TEMPLATES[:args.tasks]]
    print(f"{len(times)} code tasks ({min(cases)}-{max(cases)} cases each), reference solutions: "
          f"verify median {statistics.median(times):.2f}s, max {max(times):.2f}s")


if __name__ == "__main__":
    main()
