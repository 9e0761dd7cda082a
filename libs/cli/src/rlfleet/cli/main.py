"""`rlfleet`: launch, inspect and stop a local platform.

    rlfleet run CONFIG.toml [--resume|--fresh] [--keep-up|--up-only]
                                                           the RL loop: warm start, baseline, async RL, report
    rlfleet up [--config FILE] [--run-id ID] [--detach]   start NATS, Redis and every service
    rlfleet status [--run-dir DIR] [--once|--watch] [--json]
                                                           live view: services, engines, queues, staleness
    rlfleet down [--run-dir DIR]                           stop exactly what a launch started
    rlfleet compose-config [--out DIR] [--config FILE]     config files of the docker compose stack

Each command imports what it needs when it runs (a thin entry point): `rlfleet down` and `rlfleet
status` load neither the services' config models nor the loop's plotting.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import threading

from rlfleet.common.config import ConfigError, load_config
from rlfleet.common.errors import StartupError

COMMANDS = ("run", "up", "down", "status", "compose-config")


def _run_dir_arg(argv: list[str], prog: str) -> str:
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--run-dir", default="runs/local", help="run directory of the launch (default runs/local)")
    return parser.parse_args(argv).run_dir


def cmd_up(argv: list[str]) -> int:
    from rlfleet.cli.health import probe, table
    from rlfleet.cli.launcher import Platform
    from rlfleet.cli.platform_config import PlatformConfig

    detach = "--detach" in argv
    argv = [a for a in argv if a != "--detach"]
    config = load_config(PlatformConfig, argv, prog="rlfleet up",
                         description="Start NATS, Redis and every service; --detach to return once healthy.")
    platform = Platform(config)
    print(f"starting rlfleet in {platform.run_dir} ...", flush=True)
    state = platform.up()  # on Ctrl-C or failure while starting, it stops what it started
    try:
        stop = threading.Event()
        if not detach:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
        rows = asyncio.run(probe(state))
        print(table(rows, state), flush=True)
        if not all(row.healthy for row in rows):
            print("rlfleet up: not every process is healthy; stopping everything", file=sys.stderr, flush=True)
            platform.down()
            return 1
        if detach:
            print(f"\nrunning detached; stop with: rlfleet down --run-dir {platform.run_dir}")
            return 0
        print("\nall healthy. Ctrl-C stops everything; a process that dies is started again.", flush=True)
        # Wake up now and then rather than block once: a test run under load saw a SIGINT that
        # never ended an unbounded wait, while the same signal later ended it at once.
        while not stop.wait(0.5):
            for event in platform.restart_dead(wait=False):
                print(event, flush=True)
    except BaseException:
        platform.down()
        raise
    killed = platform.down()
    print("stopped" + (f" (killed after timeout: {', '.join(killed)})" if killed else ""))
    return 0


def cmd_run(argv: list[str]) -> int:
    from rlfleet.cli.rl_loop import main as run_main

    return run_main(argv)


def cmd_down(argv: list[str]) -> int:
    from rlfleet.cli.launcher import PlatformState, mark_stopping, stop_processes

    state = PlatformState.load(_run_dir_arg(argv, "rlfleet down"))
    mark_stopping(state.run_dir)  # a running `rlfleet run` stops its run rather than restart these
    names = [p.name for p in state.processes]
    killed = stop_processes(state.processes, 10.0)
    state.processes = []
    state.save()
    print(f"stopped {', '.join(names) or 'nothing'}" + (f"; killed: {', '.join(killed)}" if killed else ""))
    return 0


def cmd_status(argv: list[str]) -> int:
    from rlfleet.cli.launcher import PlatformState
    from rlfleet.cli.status_view import show

    parser = argparse.ArgumentParser(prog="rlfleet status", description="A live view of a launched platform: "
                                     "services, engines and their versions, queue depths, staleness, throughput.")
    parser.add_argument("--run-dir", default="runs/local", help="run directory of the launch (default runs/local)")
    parser.add_argument("--once", action="store_true", help="print one snapshot and exit (1 if a process is "
                        "unhealthy); the default when the output is not a terminal, so scripts never hang")
    parser.add_argument("--watch", action="store_true", help="refresh until Ctrl-C even when the output is not a terminal")
    parser.add_argument("--json", action="store_true", help="snapshots as JSON")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    args = parser.parse_args(argv)
    if args.interval <= 0:
        parser.error("--interval must be > 0")
    state = PlatformState.load(args.run_dir)
    if not state.processes:
        print(f"nothing is running for {state.run_dir}")
        return 1
    once = args.once or not (args.watch or sys.stdout.isatty())
    return show(state, once=once, as_json=args.json, interval_s=args.interval)


def cmd_compose_config(argv: list[str]) -> int:
    from rlfleet.cli.compose_config import main as compose_main

    return compose_main(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip())
        raise SystemExit(0 if not argv or argv[0] in ("-h", "--help") else 2)
    command = {"run": cmd_run, "up": cmd_up, "down": cmd_down, "status": cmd_status,
               "compose-config": cmd_compose_config}[argv[0]]
    try:
        raise SystemExit(command(argv[1:]))
    except (ConfigError, StartupError) as exc:
        print(f"rlfleet {argv[0]}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        print(f"rlfleet {argv[0]}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
