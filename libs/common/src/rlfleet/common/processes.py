"""Child processes started here and stopped by their PID, waiting for them to be ready, free ports.

The one harness every test fixture, benchmark and the launcher use:

    proc = ServiceProcess("rlfleet-gateway", workdir, config={"redis": {"url": url}}).start()
    proc.address        # host:port of its gRPC server, from the ready file it wrote
    proc.stop()         # SIGTERM, SIGKILL after a grace period; proc.kill() is a crash

A process that exits before it is ready, or is not ready in time, raises `ProcessNotReady` (a
`StartupError`) saying why, with the end of its log.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from rlfleet.common.config import nested
from rlfleet.common.errors import StartupError

T = TypeVar("T")
BIN = Path(sys.executable).parent


class ProcessNotReady(StartupError):
    """A child that exited before it was ready, or was not ready in time."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now; a server that can bind port 0 and report it is better (no race)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


def find_binary(name: str) -> str:
    """A console script or binary beside this interpreter (the venv), else from PATH."""
    beside = BIN / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise StartupError(f"{name} is not installed (run `make install`)")
    return found


def read_json(path: Path) -> dict | None:
    """The JSON object in `path`, or None while it is missing or half written."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def write_json_atomic(path: str | Path, payload: Any) -> Path:
    """Writes to a temporary file and renames it into place, so a reader never sees half a file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str))  # paths as strings
    tmp.replace(target)
    return target


def wait_until(predicate: Callable[[], T | None], timeout_s: float, what: str = "condition",
               process: ChildProcess | None = None, every_s: float = 0.05) -> T:
    """Polls `predicate` until it returns something truthy, which is returned; fails early when
    `process` exits meanwhile."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if process is not None and process.returncode is not None:
            raise ProcessNotReady(f"{what} exited with code {process.returncode}: {process.failure_log()}")
        if time.monotonic() > deadline:
            where = f": {process.failure_log()}" if process is not None else ""
            raise ProcessNotReady(f"{what} was not ready after {timeout_s:.0f} s{where}")
        time.sleep(every_s)


async def eventually(predicate: Callable[[], Any], within_s: float = 20.0, every_s: float = 0.05,
                     message: str = "") -> Any:
    """Polls `predicate` (a function or a coroutine function) until it returns something truthy,
    which is returned; an AssertionError after `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {within_s}s: {message or predicate}")
        await asyncio.sleep(every_s)


def last_log_line(log: Path | None) -> str:
    """The last line of a log, the `msg` of a JSON one, with where the whole log is."""
    if log is None or not log.exists():
        return "(no log)"
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    if not lines:
        return f"(empty log {log})"
    text = lines[-1]
    try:
        text = json.loads(text).get("msg", text)
    except (json.JSONDecodeError, AttributeError):
        pass
    return f"{text[:300]} (see {log})"


class ChildProcess:
    """A process started here, its output appended to `log_path`, stopped only by its own PID.

    `new_session` starts it in a session of its own, so Ctrl-C in a terminal reaches only the parent
    (which then stops its children in order) and `stop` signals its whole process group.
    `log_lines` is how much of the log a failure shows: tests want the traceback, the launcher one
    line."""

    def __init__(self, argv: list[str], log_path: Path, *, env: dict[str, str] | None = None,
                 new_session: bool = False, name: str = "", log_lines: int = 40) -> None:
        self.argv = [str(a) for a in argv]
        self.log_path = Path(log_path)
        self.env = env
        self.new_session = new_session
        self.name = name or Path(self.argv[0]).name
        self.log_lines = log_lines
        self.process: subprocess.Popen | None = None

    def spawn(self) -> ChildProcess:
        """Starts the process without waiting for it, so several can start at once."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=self.env,
                                            start_new_session=self.new_session)
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} was never started"
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def wait_for_file(self, path: Path, timeout_s: float = 60.0) -> dict:
        """The JSON the process writes to `path` once it is ready."""
        return wait_until(lambda: read_json(path), timeout_s, self.name, self)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def failure_log(self) -> str:
        if self.log_lines <= 1:
            return last_log_line(self.log_path)
        tail = self.log().splitlines()[-self.log_lines:]
        return f"(see {self.log_path})\n" + "\n".join(tail)

    def _signal(self, sig: int) -> None:
        try:
            if self.new_session:
                os.killpg(self.pid, sig)
            else:
                os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL: the process dies as in a crash, with no chance to clean up."""
        if self.returncode is None and self.process is not None:
            self._signal(signal.SIGKILL)
            self.process.wait(15)

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after `grace_s`; returns the exit status."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.returncode

    def __enter__(self) -> ChildProcess:
        return self.spawn()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class ServiceProcess(ChildProcess):
    """An rlfleet process (a service or an engine) that writes a ready file once it serves.

    `script` is a console script beside this interpreter, or a whole argv. `config` (keys may be
    dotted: `{"metrics.enabled": False}`) is written to a JSON file in `workdir` and given with
    `--config`; `args` (flags) come after it and win, as on a
    command line. `info` is what the ready file says: `grpc_address` and `metrics_port` for a
    service, `url` and `port` for an engine."""

    env: dict[str, str]  # always given to ChildProcess: __init__ builds it

    def __init__(self, script: str | list[str], workdir: Path, *args: Any, config: dict | None = None,
                 env: dict[str, str] | None = None, name: str = "", new_session: bool = False,
                 log_lines: int = 40, log_path: Path | None = None, ready_file: Path | None = None) -> None:
        argv = [find_binary(script)] if isinstance(script, str) else list(script)
        self.workdir = Path(workdir)
        name = name or (script if isinstance(script, str) else Path(argv[0]).name)
        stamp = time.monotonic_ns()
        self.ready_file = ready_file or self.workdir / f"{name}-{stamp}.ready.json"
        self.config_file: Path | None = None
        if config is not None:
            self.config_file = self.workdir / f"{name}-{stamp}.config.json"
            argv += ["--config", str(self.config_file)]
        self.config = config
        argv += [*(str(a) for a in args), "--ready-file", str(self.ready_file)]
        # Tests share a few cores: one math-library thread per process unless `env` says otherwise.
        default_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        super().__init__(argv, log_path or self.workdir / f"{name}-{stamp}.log",
                         env={**default_env, **(env or {})}, new_session=new_session, name=name,
                         log_lines=log_lines)
        self.info: dict[str, Any] = {}

    def spawn(self) -> ServiceProcess:
        from rlfleet.common.security import SECRETS_ENV, ensure_local_credentials

        # Every service needs a run's secrets; a test or benchmark that set none gets one made for it.
        self.env.setdefault(SECRETS_ENV, str(ensure_local_credentials()))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.ready_file.unlink(missing_ok=True)
        if self.config_file is not None and self.config is not None:  # set together in __init__
            write_json_atomic(self.config_file, nested(self.config))
        super().spawn()
        return self

    def wait_ready(self, timeout_s: float = 60.0) -> ServiceProcess:
        try:
            self.info = self.wait_for_file(self.ready_file, timeout_s)
        except ProcessNotReady:
            self.stop()
            raise
        return self

    def start(self, timeout_s: float = 60.0) -> ServiceProcess:
        return self.spawn().wait_ready(timeout_s)

    @property
    def address(self) -> str:
        return self.info["grpc_address"]

    @property
    def url(self) -> str:
        return self.info["url"]

    @property
    def port(self) -> int:
        return self.info.get("port") or self.info["grpc_port"]

    @property
    def metrics_port(self) -> int:
        return self.info.get("metrics_port", 0)

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def __enter__(self) -> ServiceProcess:
        return self.start()


# -- NATS and Redis ------------------------------------------------------------------------------


class NatsServer(ChildProcess):
    """`nats-server` with JetStream in `directory`, on a port it picks itself (`wait_url` reads it
    back from the ports file it writes, so there is no race for a port), or on `port` (a restart
    comes back where its clients reconnect to)."""

    def __init__(self, directory: Path, max_payload_bytes: int = 8 << 20, binary: str = "",
                 port: int = -1, authorization: str = "", tls: tuple[str, str] | None = None,
                 **kwargs: Any) -> None:
        self.directory = Path(directory)
        self.port = port
        self.authorization = authorization  # rlfleet.common.infra_auth.nats_authorization; "" = open
        # (key and certificate PEM, CA certificate): rlfleet.common.security.server_tls_files; TLS only
        self.tls = tls
        self.ports_dir = self.directory / "ports"
        self.conf = self.directory / "nats.conf"
        self.max_payload_bytes = max_payload_bytes
        self.url = ""
        log = kwargs.pop("log_path", None) or self.directory / "nats.log"
        kwargs.setdefault("name", "nats-server")
        super().__init__([binary or find_binary("nats-server"), "-c", str(self.conf)], log, **kwargs)

    def spawn(self) -> NatsServer:
        self.ports_dir.mkdir(parents=True, exist_ok=True)
        self.write_conf(self.port)
        super().spawn()
        return self

    def write_conf(self, port: int) -> None:
        """The server's config file (0600: it holds the users' passwords); -1 lets it pick a free port."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as conf:
            conf.write(f"listen: 127.0.0.1:{port}\n"
                       f"max_payload: {self.max_payload_bytes}\n"
                       f"ports_file_dir: {json.dumps(str(self.ports_dir))}\n"
                       f"jetstream {{ store_dir: {json.dumps(str(self.directory / 'jetstream'))} }}\n"
                       f"{nats_tls_block(*self.tls) if self.tls else ''}"
                       f"{self.authorization}")

    def wait_url(self, timeout_s: float = 15.0) -> str:
        ports_file = self.ports_dir / f"{Path(self.argv[0]).name}_{self.pid}.ports"

        def client_url() -> str | None:
            data = read_json(ports_file)
            if not data or not data.get("nats"):
                return None
            url = data["nats"][0]
            return "tls://" + url.split("://", 1)[1] if self.tls else url

        return wait_until(client_url, timeout_s, self.name, self)


def nats_tls_block(pem_file: str, ca_file: str) -> str:
    """nats-server's `tls {}`: clients must speak TLS (a plaintext one is refused at its first
    byte); the server's certificate is the run CA's. No client certificate is demanded: workers on
    other teams' machines hold a login and the CA, not a certificate (the login is what authorizes)."""
    return (f"tls {{ cert_file: {json.dumps(pem_file)}, key_file: {json.dumps(pem_file)}, "
            f"ca_file: {json.dumps(ca_file)}, timeout: 5 }}\n")


def redis_tls_args(port: int, pem_file: str, ca_file: str) -> list[str]:
    """redis-server TLS-only on `port` (`--port 0`: no plaintext listener), mutual TLS: a client
    without a certificate of the run's CA is refused at the handshake, before any password."""
    return ["--port", "0", "--tls-port", str(port), "--tls-cert-file", pem_file, "--tls-key-file", pem_file,
            "--tls-ca-cert-file", ca_file, "--tls-auth-clients", "yes"]


class RedisServer(ChildProcess):
    """`redis-server` on `port` with its files in `directory`; with `aclfile`
    (rlfleet.common.infra_auth.redis_acl) only its users get in; with `tls` (key and certificate
    PEM, CA certificate: rlfleet.common.security.server_tls_files) only over mutual TLS (rediss://)."""

    def __init__(self, directory: Path, port: int, appendonly: bool = False, binary: str = "redis-server",
                 aclfile: Path | None = None, tls: tuple[str, str] | None = None, **kwargs: Any) -> None:
        self.directory = Path(directory)
        self.port = port
        self.url = f"{'rediss' if tls else 'redis'}://127.0.0.1:{port}/0"
        log = kwargs.pop("log_path", None) or self.directory / "redis.log"
        listen = redis_tls_args(port, *tls) if tls else ["--port", str(port)]
        argv = [find_binary(binary), "--bind", "127.0.0.1", *listen, "--dir", str(self.directory),
                "--save", "", "--appendonly", "yes" if appendonly else "no", "--daemonize", "no",
                "--protected-mode", "yes", *(["--aclfile", str(aclfile)] if aclfile else [])]
        kwargs.setdefault("name", "redis-server")
        super().__init__(argv, log, **kwargs)

    def spawn(self) -> RedisServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        super().spawn()
        return self

    def wait_url(self, timeout_s: float = 10.0) -> str:
        wait_until(lambda: port_open(self.port), timeout_s, self.name, self)
        return self.url


def start_nats(directory: Path, **kwargs: Any) -> NatsServer:
    server = NatsServer(directory, **kwargs).spawn()
    try:
        server.url = server.wait_url()
    except BaseException:
        server.stop()
        raise
    return server


def start_redis(directory: Path, attempts: int = 5, timeout_s: float = 10.0,
                before_wait: Callable[[RedisServer], None] = lambda server: None,
                **kwargs: Any) -> RedisServer:
    """Redis on a free port; another port when the one probed was taken before Redis bound it.
    `before_wait` sees each server as soon as it runs (the launcher records it there)."""
    for _ in range(attempts):
        server = RedisServer(directory, free_port(), **kwargs).spawn()
        before_wait(server)
        try:
            server.wait_url(timeout_s)
        except ProcessNotReady:
            if server.returncode is None:
                server.stop()
                raise
            continue  # lost the port between probe and bind: try another
        return server
    log = kwargs.get("log_path") or Path(directory) / "redis.log"
    raise StartupError(f"redis-server could not bind a port: {last_log_line(log)}")
