"""CPU cost of one sandboxed exec: the driver's own process plus everything it spawns.

    sudo .venv/bin/python bench/sandbox_exec_cpu.py [-n 100] [--cgroups auto] [--variants baseline ...]

Runs N execs of the calc suite's tool (`python3 -I -S -c SCRIPT`, an expression on stdin) and N of
`/bin/true` through the real `BubblewrapDriver`, in one sandbox, one after another, and prints per
exec: the CPU seconds of this process (the driver's Python work, threads included) and of its
reaped children (the whole bwrap chain and the program: RUSAGE_CHILDREN), their sum, what the
driver reported as the exec's `cpu_s`, and the wall time (p50, p90). CPU time is what matters on a
loaded machine: it is what the other processes lose, and it is far less noisy than wall time there.

`--variants` measures the same workloads with the sandbox's command line altered, *to attribute the
cost only* (several variants are not safe to run for real: no seccomp, no uid switch...):
    baseline       the driver as it is
    py-site        the calc tool without -S (what `site` costs)
    no-tini        bwrap's own init instead of tini
    no-net         no --unshare-net
    no-seccomp     no --seccomp filter
    no-prlimit     no prlimit step in the chain (if the driver has one)
    no-setpriv     no setpriv step in the chain (if the driver has one): runs as root!
    no-cgroup-hop  no `sh` hop joining the exec cgroup (if the driver has one)
    bare-true      bwrap with just --ro-bind /usr etc., as a floor for bwrap itself (/bin/true only)
Not counted anywhere: work the kernel does later in its own threads (network-namespace teardown).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rlfleet.envkit.suites import calc
from rlfleet.sandbox import bwrap_command
from rlfleet.sandbox.bubblewrap import BubblewrapConfig, BubblewrapDriver

TINIS = ("/usr/bin/tini", "/usr/bin/tini-static")
CALC_STDIN = b"(37+48)*512-17\n"
CALC_OUT = b"43503\n"


def _drop(flag: str, nargs: int = 0) -> Callable[[list[str]], list[str]]:
    def edit(argv: list[str]) -> list[str]:
        out, i = [], 0
        while i < len(argv):
            if argv[i] == flag:
                i += 1 + nargs
                continue
            out.append(argv[i])
            i += 1
        return out

    return edit


def _drop_step(tool: str) -> Callable[[list[str]], list[str]]:
    """Remove `tool ARGS... --` from the chain (prlimit/setpriv style steps)."""

    def edit(argv: list[str]) -> list[str]:
        if tool not in argv:
            return argv
        i = argv.index(tool)
        j = argv.index("--", i)
        return argv[:i] + argv[j + 1 :]

    return edit


def _no_tini(argv: list[str]) -> list[str]:
    argv = _drop("--as-pid-1")(argv)
    for tini in TINIS:
        if tini in argv:
            i = argv.index(tini)
            del argv[i : i + 2]  # tini --
    return argv


def _no_cgroup_hop(argv: list[str]) -> list[str]:  # the `sh` hop of drivers that have one
    if argv[:2] == ["/bin/sh", "-c"]:
        n = int(argv[4])
        return argv[5 + n :]
    return argv


def _bare(argv: list[str]) -> list[str]:
    i = argv.index("--json-status-fd")
    bwrap = next(a for a in argv if a.endswith("bwrap"))
    return [
        bwrap,
        "--ro-bind",
        "/usr",
        "/usr",
        "--symlink",
        "usr/lib",
        "/lib",
        "--symlink",
        "usr/lib64",
        "/lib64",
        "--symlink",
        "usr/bin",
        "/bin",
        "--json-status-fd",
        argv[i + 1],
        "--",
        "/bin/true",
    ]


EDITS: dict[str, Callable[[list[str]], list[str]] | None] = {
    "baseline": None,
    "py-site": None,
    "no-tini": _no_tini,
    "no-net": _drop("--unshare-net"),
    "no-seccomp": _drop("--seccomp", 1),
    "no-prlimit": _drop_step("/usr/bin/prlimit"),
    "no-setpriv": _drop_step("/usr/bin/setpriv"),
    "no-cgroup-hop": _no_cgroup_hop,
    "bare-true": _bare,
}


def _patch(edit: Callable[[list[str]], list[str]] | None) -> Callable[[], None]:
    """Alter the argv the driver builds (measurement only); returns the undo."""
    original = bwrap_command.Sandboxing.command
    if edit is None:
        return lambda: None

    def command(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return edit(list(original(self, *args, **kwargs)))

    bwrap_command.Sandboxing.command = command  # type: ignore[method-assign]

    def undo() -> None:
        bwrap_command.Sandboxing.command = original  # type: ignore[method-assign]

    return undo


def _cpu() -> tuple[float, float]:
    t = os.times()
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    return t.user + t.system, ch.ru_utime + ch.ru_stime


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def measure(root: Path, variant: str, n: int, cgroups: str, uid_base: int) -> dict[str, dict]:
    config = BubblewrapConfig(root=root, pool_size=0, cgroups=cgroups, uid_base=uid_base, max_sandboxes=8)
    workloads: dict[str, tuple[list[str], bytes, bytes]] = {
        "calc": (list(calc.CALC_TOOL_ARGV), CALC_STDIN, CALC_OUT),
        "true": (["/bin/true"], b"", b""),
    }
    if variant == "py-site":
        argv = [a for a in calc.CALC_TOOL_ARGV if a != "-S"]
        workloads = {"calc": (argv, CALC_STDIN, CALC_OUT)}
    if variant == "bare-true":
        workloads = {"true": workloads["true"]}
    out: dict[str, dict] = {}
    async with BubblewrapDriver(config) as driver:
        undo = _patch(EDITS[variant])
        try:
            handle = await driver.create()
            for name, (argv, stdin, expect) in workloads.items():
                for _ in range(3):  # warm-up: page cache, first-use allocations
                    await driver.exec(handle, argv, stdin=stdin)
                walls, reported = [], []
                self0, kids0 = _cpu()
                for _ in range(n):
                    t0 = time.perf_counter()
                    r = await driver.exec(handle, argv, stdin=stdin)
                    walls.append(time.perf_counter() - t0)
                    reported.append(r.cpu_s)
                    if r.exit_code != 0 or r.stdout != expect:
                        raise SystemExit(f"{variant}/{name}: unexpected result {r}")
                self1, kids1 = _cpu()
                out[name] = {
                    "self_ms": (self1 - self0) / n * 1000,
                    "children_ms": (kids1 - kids0) / n * 1000,
                    "total_ms": ((self1 - self0) + (kids1 - kids0)) / n * 1000,
                    "reported_cpu_ms": statistics.fmean(reported) * 1000,
                    "wall_p50_ms": pct(walls, 50) * 1000,
                    "wall_p90_ms": pct(walls, 90) * 1000,
                }
            await driver.destroy(handle)
        finally:
            undo()
        out["_enforcement"] = driver.enforcement
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", "--execs", type=int, default=100, help="measured execs per workload")
    parser.add_argument("--cgroups", choices=["auto", "off"], default="auto")
    parser.add_argument("--variants", nargs="+", choices=list(EDITS), default=["baseline"])
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    report: dict[str, dict] = {}
    enforcement: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-") as tmp:
        for k, variant in enumerate(args.variants):
            res = asyncio.run(
                measure(Path(tmp) / variant, variant, args.execs, args.cgroups, 910_000 + 8 * k)
            )
            enforcement = res.pop("_enforcement")
            report[variant] = res
    print(
        f"sandbox exec CPU, {args.execs} execs per row, "
        f"python {sys.version.split()[0]}, {os.cpu_count()} cpus"
    )
    print(f"limits via: {enforcement['cgroups']}; accounting: {enforcement['accounting']}")
    cols = ("self_ms", "children_ms", "total_ms", "reported_cpu_ms", "wall_p50_ms", "wall_p90_ms")
    print(f"{'variant':<15}{'tool':<6}" + "".join(f"{c.removesuffix('_ms') + ' ms':>16}" for c in cols))
    for variant, tools in report.items():
        for tool, s in tools.items():
            print(f"{variant:<15}{tool:<6}" + "".join(f"{s[c]:>16.2f}" for c in cols))
    if args.json:
        args.json.write_text(json.dumps({"execs": args.execs, "results": report}, indent=2))


if __name__ == "__main__":
    main()
