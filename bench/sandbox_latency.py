"""Sandbox latency: create + exec(`python3 -c "print(1)"`) + destroy, cold and with a warm pool.

    sudo .venv/bin/python bench/sandbox_latency.py [-n 50] [--pool-size 4] [--json out.json]

Cold: no pool, every create prepares its workspace (and cgroup) on the request path. Warm: a pool
of pre-made sandboxes; before each iteration the bench waits (untimed) until the pool has refilled,
i.e. the steady state of a pool that keeps up with demand. Prints p50/p99 per phase and in total.
Figures, not pass/fail: the exec (bwrap + namespaces + Python start-up) dominates.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rlfleet.sandbox.bubblewrap import BubblewrapConfig, BubblewrapDriver

PHASES = ("create", "exec", "destroy", "total")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def measure(root: Path, *, pool_size: int, iterations: int, cgroups: str) -> dict[str, list[float]]:
    config = BubblewrapConfig(
        root=root, pool_size=pool_size, cgroups=cgroups, uid_base=900_000, max_sandboxes=64
    )
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    async with BubblewrapDriver(config) as driver:
        for i in range(iterations + 2):  # two warm-up rounds, not recorded
            if pool_size:
                await driver.pool.wait_full()
            t0 = time.perf_counter()
            handle = await driver.create()
            t1 = time.perf_counter()
            result = await driver.exec(handle, ["python3", "-c", "print(1)"])
            t2 = time.perf_counter()
            await driver.destroy(handle)
            t3 = time.perf_counter()
            if result.stdout != b"1\n":
                raise SystemExit(f"unexpected exec result: {result}")
            if i >= 2:
                for phase, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
                    times[phase].append(dt * 1000)
        enforcement = driver.enforcement
    times["_enforcement"] = enforcement  # type: ignore[assignment]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", "--iterations", type=int, default=50)
    parser.add_argument("--pool-size", type=int, default=4)
    parser.add_argument("--cgroups", choices=["auto", "off"], default="auto")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    report: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-") as tmp:
        for mode, pool_size in (("cold", 0), ("warm", args.pool_size)):
            times = asyncio.run(
                measure(
                    Path(tmp) / mode, pool_size=pool_size, iterations=args.iterations, cgroups=args.cgroups
                )
            )
            enforcement = times.pop("_enforcement")
            report[mode] = {
                phase: {
                    "p50_ms": percentile(v, 50),
                    "p99_ms": percentile(v, 99),
                    "mean_ms": statistics.fmean(v),
                }
                for phase, v in times.items()
            }
    print(f"sandbox latency, {args.iterations} iterations each, python {sys.version.split()[0]}")
    print(f"limits via: {enforcement['cgroups']}; accounting: {enforcement['accounting']}")
    print(f"{'mode':<6}{'phase':<9}{'p50 ms':>9}{'p99 ms':>9}{'mean ms':>9}")
    for mode, phases in report.items():
        for phase, s in phases.items():
            print(f"{mode:<6}{phase:<9}{s['p50_ms']:>9.2f}{s['p99_ms']:>9.2f}{s['mean_ms']:>9.2f}")
    if args.json:
        args.json.write_text(json.dumps({"iterations": args.iterations, "results": report}, indent=2))


if __name__ == "__main__":
    main()
