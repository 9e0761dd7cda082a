"""`rlfleet`: launch, inspect and stop a local platform.

    rlfleet run CONFIG.toml [--resume|--fresh] [--keep-up|--up-only]
                                                           the RL loop: warm start, baseline, async RL, report
    rlfleet up [--config FILE] [--run-id ID] [--detach]   start NATS, Redis and every service
    rlfleet status [--run-dir DIR] [--once|--watch] [--json]
                                                           live view: services, engines, queues, staleness
    rlfleet down [--run-dir DIR]                           stop exactly what a launch started
    rlfleet compose-config [--out DIR] [--config FILE]     config files of the docker compose stack
    rlfleet token issue NAME [--run-dir DIR] [--run-id ID] [--expires-in-s S]
                                                           an environment client's token (printed once)
    rlfleet token revoke TOKEN_ID [--run-dir DIR]          every service refuses it within a second
    rlfleet token list [--run-dir DIR] [--json]            issued tokens (ids, names, runs; no secrets)

Each command imports what it needs when it runs (a thin entry point): `rlfleet down` and `rlfleet
status` load neither the services' config models nor the loop's plotting.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import threading
from pathlib import Path

from rlfleet.common.config import ConfigError, load_config
from rlfleet.common.errors import InvalidArgument, StartupError

COMMANDS = ("run", "up", "down", "status", "compose-config", "token")


def _run_dir_arg(argv: list[str], prog: str) -> str:
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--run-dir", default="runs/local",
                        help="run directory of the launch (default runs/local)")
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
            print("rlfleet up: not every process is healthy; stopping everything",
                  file=sys.stderr, flush=True)
            platform.down()
            return 1
        if detach:
            print(f"\nrunning detached; stop with: rlfleet down --run-dir {platform.run_dir}")
            return 0
        print("\nall healthy. Ctrl-C stops everything; a process that dies is started again.", flush=True)
        platform.start_standbys()
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
    from rlfleet.cli.run_client import main as run_main

    return run_main(argv)


def cmd_down(argv: list[str]) -> int:
    from rlfleet.cli.launcher import PlatformState, mark_stopping, stop_processes
    from rlfleet.cli.platform_config import DEFAULT_STOP_TIMEOUT_S

    state = PlatformState.load(_run_dir_arg(argv, "rlfleet down"))
    mark_stopping(state.run_dir)  # a running `rlfleet run` stops its run rather than restart these
    names = [p.name for p in state.processes]
    # As long as the launch was told to wait.
    stop_timeout_s = float(state.config.get("stop_timeout_s", DEFAULT_STOP_TIMEOUT_S))
    killed = stop_processes(state.standbys + state.processes, stop_timeout_s)
    state.processes, state.standbys = [], []
    state.save()
    print(f"stopped {', '.join(names) or 'nothing'}" + (f"; killed: {', '.join(killed)}" if killed else ""))
    return 0


def cmd_status(argv: list[str]) -> int:
    from pathlib import Path

    from rlfleet.cli.launcher import PlatformState, use_run_secrets
    from rlfleet.cli.status_view import show

    parser = argparse.ArgumentParser(prog="rlfleet status", description="A live view of a launched platform: "
                                     "services, engines and their versions, queue depths, "
                                     "staleness, throughput.")
    parser.add_argument("--run-dir", default="runs/local",
                        help="run directory of the launch (default runs/local)")
    parser.add_argument("--once", action="store_true", help="print one snapshot and exit (1 if a process is "
                        "unhealthy); the default when the output is not a terminal, so scripts never hang")
    parser.add_argument("--watch", action="store_true",
                        help="refresh until Ctrl-C even when the output is not a terminal")
    parser.add_argument("--json", action="store_true", help="snapshots as JSON")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    args = parser.parse_args(argv)
    if args.interval <= 0:
        parser.error("--interval must be > 0")
    state = PlatformState.load(args.run_dir)
    if not state.processes:
        print(f"nothing is running for {state.run_dir}")
        return 1
    use_run_secrets(Path(state.run_dir), state.run_id)
    once = args.once or not (args.watch or sys.stdout.isatty())
    return show(state, once=once, as_json=args.json, interval_s=args.interval)


def cmd_compose_config(argv: list[str]) -> int:
    from rlfleet.cli.compose_config import main as compose_main

    return compose_main(argv)


def cmd_token(argv: list[str]) -> int:
    import json
    from pathlib import Path

    from rlfleet.common import security

    parser = argparse.ArgumentParser(prog="rlfleet token", description="Issue, revoke and list the tokens "
                                     "environment clients call the platform with.")
    parser.add_argument("action", choices=("issue", "revoke", "list"))
    parser.add_argument("subject", nargs="?", default="",
                        help="issue: the client's name; revoke: the token id")
    parser.add_argument("--run-dir", default="runs/local",
                        help="run directory of the launch (default runs/local)")
    parser.add_argument("--run-id", default="", help="run the token is for (default: the run directory's)")
    parser.add_argument("--expires-in-s", type=float, default=0.0,
                        help="lifetime in seconds; 0 = until revoked")
    parser.add_argument("--json", action="store_true", help="list as JSON")
    parser.add_argument("--redis-url", default="", help="revoke: the run's Redis, where services on other "
                        "hosts read revocations (default: the platform launched in --run-dir); login as the "
                        "operator user from the run directory's secrets or RLFLEET__REDIS__USER / __PASSWORD")
    args = parser.parse_args(argv)
    directory = security.run_secrets_dir(args.run_dir)
    if not (directory / "token.key").exists():
        raise StartupError(f"{directory} has no token key: start the platform there first (`rlfleet up`)")
    if args.action == "issue":
        run_file = directory / "run_id"
        run_id = args.run_id or (run_file.read_text().strip() if run_file.exists() else "")
        if not run_id:
            raise StartupError("--run-id is needed: the run directory does not say its run")
        token, record = security.issue_token(directory, run_id, args.subject, args.expires_in_s)
        print(f"# token {record['id']} for client {record['name']!r} on run {run_id!r}; give the client:",
              file=sys.stderr)
        print(f"#   RLFLEET_TOKEN=<the line below>  RLFLEET_CA_FILE={Path(directory, 'ca.pem').resolve()}",
              file=sys.stderr)
        print(token)
    elif args.action == "revoke":
        security.revoke_token(directory, args.subject)
        print(f"revoked {args.subject}")
        _revoke_in_redis(Path(args.run_dir), args.subject, args.redis_url)
    else:
        rows = security.list_tokens(directory)
        if args.json:
            print(json.dumps(rows, indent=2))
        for row in [] if args.json else rows:
            state = "revoked" if row["revoked"] else "active"
            print(f"{row['id']}  {row['name']:<24} run={row['run']:<16} {state}")
    return 0


def _revoke_in_redis(run_dir: Path, token_id: str, redis_url: str) -> None:
    """The revocation into the run's Redis too, which every service polls (rlfleet.common.revocations):
    how containers and pods with their own copy of the secrets learn of it. Best effort: the file is
    the record, and `rlfleet up` copies it into Redis when it starts Redis again."""
    import os

    from rlfleet.cli.launcher import PlatformState, use_run_secrets
    from rlfleet.common import revocations, security
    from rlfleet.common.infra_auth import run_dir_login

    run_file = security.run_secrets_dir(run_dir) / "run_id"
    run_id = run_file.read_text().strip() if run_file.exists() else ""
    if not redis_url:
        try:
            state = PlatformState.load(run_dir)
            redis_url, run_id = state.by_name("redis").url, state.run_id
        except (StartupError, KeyError, LookupError):
            print("# no platform is running in the run directory: services sharing it read the file; give "
                  "--redis-url to tell services on other hosts", file=sys.stderr)
            return
    login = run_dir_login(run_dir, "redis", "operator") or {
        "user": os.environ.get("RLFLEET__REDIS__USER", "operator"),
        "password": os.environ.get("RLFLEET__REDIS__PASSWORD", ""),
        "password_file": os.environ.get("RLFLEET__REDIS__PASSWORD_FILE", "")}
    if security.run_secrets_dir(run_dir).joinpath("ca.key").exists():
        use_run_secrets(run_dir, run_id)  # the operator's certificate for Redis's mutual TLS
    try:
        revocations.publish_ids(redis_url, login, run_id, [token_id])
    except Exception as exc:  # redis-py's errors and a refused TLS handshake alike
        print(f"# warning: not recorded in Redis at {redis_url} ({exc}); services on other hosts still "
              "accept the token", file=sys.stderr)
        return
    print(f"# services of run {run_id!r} refuse it within ~{revocations.POLL_S:.0f} s", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip())
        raise SystemExit(0 if not argv or argv[0] in ("-h", "--help") else 2)
    command = {"run": cmd_run, "up": cmd_up, "down": cmd_down, "status": cmd_status,
               "compose-config": cmd_compose_config, "token": cmd_token}[argv[0]]
    try:
        raise SystemExit(command(argv[1:]))
    except (ConfigError, StartupError, InvalidArgument) as exc:
        print(f"rlfleet {argv[0]}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        print(f"rlfleet {argv[0]}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
