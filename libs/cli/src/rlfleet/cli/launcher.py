"""The local launcher: NATS, Redis and the services as child processes of one run directory.

Everything a launch starts is recorded in `<run_dir>/platform.json` (PID, command line, log file,
address), so `rlfleet down` and `rlfleet status` work from another shell, and stopping never
touches a process that is not ours: a PID is only signalled while its start time still
matches the one recorded.

Supervision (`Platform.restart_dead`, what compose's restart policy and Kubernetes do for their
deployments): once a process serves, its ports are written into its own config file (gRPC and
metrics port of a service, an engine's port, NATS's `listen`; Redis has `--port` on its command
line), so a process that died is started again with its recorded command line and comes back on
the same addresses its peers already know. Restarts back off exponentially up to a bound, are
counted in platform.json (count, last exit, time) and shown by `rlfleet status`.

Standbys (`restart.standby`): beside each service named there (by default every one: a cold start is
mostly imports, the trainer's torch and transformers above all, and under load each second of
them is several), the launcher keeps a `--standby` process (rlfleet.common.standby) that has done its imports
and waits; when the service dies its standby is promoted with one signal instead of a cold start,
and a new standby is started once the promoted one serves. A standby holds no port, stream or
state, so promoting one is the same restart as a cold one, only sooner; with no standby waiting
(still importing, dead, or started by another launcher of the platform) the restart is a cold start.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlfleet.cli.platform_config import SECTIONS, EngineConfig, PlatformConfig
from rlfleet.cli.warm_start import build_model_command
from rlfleet.common import security, standby
from rlfleet.common.config import ConfigError, ProcessConfig, propagate
from rlfleet.common.errors import StartupError
from rlfleet.common.infra_auth import (
    ensure_infra_secrets,
    nats_authorization,
    planned_secrets,
    redis_acl,
    run_dir_login,
    secrets_dir,
    write_secret,
)
from rlfleet.common.processes import (
    ChildProcess,
    NatsServer,
    RedisServer,
    find_binary,
    last_log_line,
    port_open,
    start_redis,
    wait_until,
    write_json_atomic,
)

STATE_FILE = "platform.json"
STOPPING_FILE = "platform.stopping"  # `rlfleet down` under way: a supervisor must not restart what it stops
INFRASTRUCTURE = ("nats", "redis")  # what every service reconnects to: restarted first


@dataclass
class ProcessRecord:
    name: str
    pid: int
    start_ticks: int        # from /proc/<pid>/stat: tells our process from a later one with its PID
    cmdline: list[str]
    log: str
    address: str = ""       # host:port (gRPC for services, client port for NATS/Redis)
    url: str = ""           # tls:// (NATS), rediss:// (Redis), http://
    metrics_port: int = 0
    kind: str = "service"   # service | nats | redis | engine | worker
    restarts: int = 0       # times the launcher started it again after it died
    last_exit: str = ""     # how it last died: "exit 1", "signal SIGKILL", "unknown"
    last_restart_unix: float = 0.0
    ready_unix: float = 0.0  # when it last came up serving after a restart


@dataclass
class PlatformState:
    run_id: str
    run_dir: str
    launcher_pid: int
    processes: list[ProcessRecord] = field(default_factory=list)
    standbys: list[ProcessRecord] = field(default_factory=list)  # waiting to take over a service that dies
    config: dict[str, Any] = field(default_factory=dict)  # the launch's PlatformConfig, to tell what it runs

    def by_name(self, name: str) -> ProcessRecord:
        for record in self.processes:
            if record.name == name:
                return record
        raise KeyError(name)

    def save(self) -> None:
        path = Path(self.run_dir) / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.rename(path)

    @classmethod
    def load(cls, run_dir: str | Path) -> PlatformState:
        path = Path(run_dir) / STATE_FILE
        if not path.exists():
            raise StartupError(f"no platform was launched in {run_dir} ({STATE_FILE} is missing)")
        data = json.loads(path.read_text())
        data["processes"] = [ProcessRecord(**p) for p in data["processes"]]
        data["standbys"] = [ProcessRecord(**p) for p in data.get("standbys", [])]
        return cls(**data)


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None when it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def is_ours(record: ProcessRecord) -> bool:
    return record.pid > 0 and start_ticks(record.pid) == record.start_ticks


def spawn(cmd: list[str], log_path: Path, name: str, env: dict[str, str] | None = None) -> ChildProcess:
    """Starts a child in a session of its own (so Ctrl-C in the terminal reaches only the launcher,
    which then stops the children in order), output appended to `log_path`; a failure to start
    says the last line of its log."""
    return ChildProcess(cmd, log_path, env=env, new_session=True, name=name, log_lines=1).spawn()


def record_of(child: ChildProcess, kind: str = "service", **fields: Any) -> ProcessRecord:
    return ProcessRecord(child.name, child.pid, start_ticks(child.pid) or 0, child.argv, str(child.log_path),
                         kind=kind, **fields)


def stop_processes(records: list[ProcessRecord], timeout_s: float) -> list[str]:
    """Stops services first and NATS/Redis last (services drain into them), each wave with SIGTERM,
    then SIGKILL for stragglers; returns the names it had to kill."""
    infrastructure = {"nats", "redis"}
    waves = [[r for r in records if r.kind not in infrastructure],
             [r for r in records if r.kind in infrastructure]]
    killed = []
    for wave in waves:
        killed += _stop_wave([r for r in reversed(wave) if is_ours(r)], timeout_s)
    return killed


def mark_stopping(run_dir: str | Path) -> None:
    """Tells a supervisor of this run directory (another shell's `rlfleet run`) that the platform
    is being stopped on purpose, so it does not start again what is stopped."""
    Path(run_dir, STOPPING_FILE).touch()


def _stop_wave(alive: list[ProcessRecord], timeout_s: float) -> list[str]:
    for record in alive:
        try:
            os.killpg(record.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    killed = []
    for record in alive:
        while is_ours(record) and time.monotonic() < deadline:
            _reap(record.pid)
            time.sleep(0.05)
        if is_ours(record):
            killed.append(record.name)
            try:
                os.killpg(record.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap(record.pid)
    return killed


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def run_dir_for(config: PlatformConfig) -> Path:
    return Path(config.run_dir or f"runs/{config.run_id}").resolve()


def engine_pool(config: PlatformConfig, index: int) -> str:
    """The pool of the launch's `index`-th engine: the canary pool's first, then the candidate's."""
    if index < config.canary_engines:
        return "canary"
    return "candidate" if index < config.canary_engines + config.candidate_engines else "fleet"


def launch_facts(name: str, config: PlatformConfig, state: PlatformState, run_dir: Path,
                 model: Path | None = None) -> dict[str, Any]:
    """What only the launch knows, for each service: NATS and Redis URLs, peer addresses, paths in
    the run directory and the model. A section that sets one of these itself wins."""
    infra = planned_secrets(secrets_dir(run_dir))  # made by _start_nats/_start_redis, before any service
    nats = lambda user: {"url": state.by_name("nats").url, **infra.nats[user].nats()}  # noqa: E731
    redis = lambda user: {"url": state.by_name("redis").url, **infra.redis[user].redis()}  # noqa: E731
    engine_records = [r for r in state.processes if r.kind == "engine"]
    engines = [{"engine_id": r.name, "url": r.url, "pool": engine_pool(config, i), "kind": "cpu"}
               for i, r in enumerate(engine_records)]
    tokenizer = {"tokenizer_path": str(model)} if model is not None else {}
    served = {"model_path": str(model)} if model is not None else {}
    weights = str(run_dir / "weights")
    gateway = _address(state, "rollout-gateway")
    facts: dict[str, dict[str, Any]] = {
        "sandbox-manager": {"redis": redis("sandbox-manager"),
                            "driver": {"root": str(run_dir / "sandboxes")}},
        "rollout-gateway": {"redis": redis("rollout-gateway"), **({"engines": engines} if engines else {})},
        # With trainer-sent weights (broker.sync.transport distributed | p2p | tensor, or per engine)
        # the trainer sends each version to the broker's plan: it starts after the broker.
        "trainer": {"nats": nats("trainer"), "weight_store": weights, **served,
                    **({"weight_send": {"broker_address": _address(state, "weight-broker")}}
                       if config.broker.trainer_sends else {})},
        "session-server": {"nats": nats("session-server"), "redis": redis("session-server"),
                           "gateway_address": gateway, **tokenizer},
        "weight-broker": {"nats": nats("weight-broker"), "redis": redis("weight-broker"),
                          "gateway_address": gateway, "weight_store": weights},
        "verifier": {"redis": redis("verifier"), "sandbox_address": _address(state, "sandbox-manager"),
                     "session_address": _address(state, "session-server"),
                     "suites_dir": str(run_dir / "suites"), **tokenizer},
        "controller": {"run_dir": str(run_dir), "nats": nats("controller"),
                       "gateway_address": gateway, "trainer_address": _address(state, "trainer"),
                       "broker_address": _address(state, "weight-broker"),
                       "verifier_address": _address(state, "verifier"),
                       "session_address": _address(state, "session-server"),
                       "sandbox_address": _address(state, "sandbox-manager"),
                       **({"trainer_metrics_url": f"http://127.0.0.1:{port}/metrics"}
                          if (port := _metrics_port(state, "trainer")) else {})},
        # Version "0": rlfleet's policy versions are integers and the initial weights are version 0.
        "cpu-engine": {"weight_version": "0", "weight_store_root": weights, **served},
    }
    return facts[name]


def process_config(name: str, config: PlatformConfig, state: PlatformState, run_dir: Path, ready: Path,
                   model: Path | None = None) -> ProcessConfig:
    """The whole config of one process: its section of the launch config, the launch's facts filled in."""
    section = config.section(name).model_copy(deep=True)
    try:
        propagate(section, launch_facts(name, config, state, run_dir, model), where=SECTIONS[name])
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    section.ready_file = str(ready)  # always the launcher's: how it knows the process serves
    return section


def write_process_config(run_dir: Path, process: str, config: ProcessConfig) -> Path:
    """`<run_dir>/config/<process>.json`: what the process is started with (`--config`)."""
    return write_json_atomic(run_dir / "config" / f"{process}.json", config.model_dump(mode="json"))


def _metrics_port(state: PlatformState, name: str) -> int:
    try:
        return state.by_name(name).metrics_port
    except KeyError:
        return 0


def _address(state: PlatformState, name: str) -> str:
    try:
        return state.by_name(name).address
    except KeyError:
        return ""  # not launched: the service fails fast with a clear message if it needs it


def flatten_keys(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf of a nested dict."""
    items = []
    for key, value in tree.items():
        if isinstance(value, dict):
            items += flatten_keys(value, f"{prefix}{key}.")
        else:
            items.append((prefix + key, value))
    return items


def model_cache(config: PlatformConfig, run_dir: Path) -> Path:
    root = Path(config.model_cache_dir).resolve() if config.model_cache_dir else run_dir.parent / ".cache"
    return root / f"model-seed{config.model_seed}"


def resolve_model(config: PlatformConfig, run_dir: Path, log: Path, timeout_s: float = 600.0) -> Path:
    """The model directory: `model_path`, or the default model built once into the cache and reused.

    The build goes to a temporary directory that is renamed into place, so a launch that is stopped
    halfway, or two launches building at once, never leave a half-written model behind."""
    if config.model_path:
        path = Path(config.model_path).resolve()
        if not (path / "config.json").exists() or not (path / "tokenizer.json").exists():
            raise StartupError(f"model_path {path} is not a model directory (config.json and tokenizer.json)")
        return path
    target = model_cache(config, run_dir)
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    building = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(building, ignore_errors=True)
    cmd = build_model_command(building, config.model_seed)
    builder = spawn(cmd, log, "build-model", env=service_env())
    assert builder.process is not None  # spawn() started it
    try:
        code = builder.process.wait(timeout_s)
    except BaseException:  # timeout or Ctrl-C: do not leave the builder running
        builder.kill()
        shutil.rmtree(building, ignore_errors=True)
        raise
    finally:
        Path(cmd[cmd.index("--corpus") + 1]).unlink(missing_ok=True)
    if code != 0:
        shutil.rmtree(building, ignore_errors=True)
        raise StartupError(f"building the default model failed (exit {code}): {last_log_line(log)}")
    try:
        building.rename(target)
    except OSError:  # another launch finished the same build first: use theirs
        shutil.rmtree(building, ignore_errors=True)
    return target


# Services that need another service's address start after it.
TIERS = (("sandbox-manager", "rollout-gateway"), ("session-server", "weight-broker"), ("verifier", "trainer"),
         ("controller",))
SCRIPTS = {
    "sandbox-manager": "rlfleet-sandbox-manager", "rollout-gateway": "rlfleet-gateway",
    "trainer": "rlfleet-trainer", "session-server": "rlfleet-session-server",
    "weight-broker": "rlfleet-weight-broker", "verifier": "rlfleet-verifier",
    "controller": "rlfleet-controller",
}


class Platform:
    """One launch: starts processes in order, records them, stops exactly them."""

    def __init__(self, config: PlatformConfig) -> None:
        unknown = sorted(set(config.services) - set(SCRIPTS))
        if unknown:
            raise StartupError(f"unknown services {unknown}; known: {', '.join(SCRIPTS)}")
        unknown = sorted(set(config.restart.standby) - set(SCRIPTS))
        if unknown:
            raise StartupError(f"restart.standby names unknown services {unknown}; "
                               f"known: {', '.join(SCRIPTS)}")
        self.config = config
        self.run_dir = run_dir_for(config)
        self.logs = self.run_dir / "logs"
        self.state = PlatformState(config.run_id, str(self.run_dir), os.getpid(),
                                   config=config.model_dump(mode="json"))
        self.model: Path | None = None
        # name -> (restarts since it was last stable, last)
        self._restart_tries: dict[str, tuple[int, float]] = {}
        self._children: dict[str, ChildProcess] = {}  # what this launcher started, to learn how it exited
        self._standbys: dict[str, ChildProcess] = {}  # service name -> its standby, started by this launcher
        self._promoted: set[str] = set()  # restarts under way that are promoted standbys
        self._lock = threading.Lock()  # restarts finish on threads of their own
        self._restarting: set[str] = set()
        self._events: list[str] = []

    @classmethod
    def attach(cls, run_dir: str | Path) -> Platform:
        """The platform launched in `run_dir` (by this process or another), to supervise or stop."""
        state = PlatformState.load(run_dir)
        platform = cls(PlatformConfig(**state.config))
        platform.state = state
        use_run_secrets(platform.run_dir, platform.config.run_id)
        return platform

    def up(self) -> PlatformState:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        use_run_secrets(self.run_dir, self.config.run_id)
        self._refuse_second_launch()
        (self.run_dir / STOPPING_FILE).unlink(missing_ok=True)
        try:
            self._start_nats()
            self._start_redis()
            if self.config.engines or "session-server" in self.config.services:
                self.model = resolve_model(self.config, self.run_dir, self.logs / "build-model.log")
            self._start_engines()
            for tier in TIERS:
                self._start_services([name for name in tier if name in self.config.services])
        except BaseException:
            self.down()
            raise
        return self.state

    def down(self) -> list[str]:
        mark_stopping(self.run_dir)
        killed = stop_processes(self.state.standbys + self.state.processes, self.config.stop_timeout_s)
        self.state.processes, self.state.standbys = [], []
        self.state.save()
        return killed

    def _refuse_second_launch(self) -> None:
        try:
            previous = PlatformState.load(self.run_dir)
        except StartupError:
            return
        running = [p.name for p in previous.processes if is_ours(p)]
        if running:
            raise StartupError(f"{self.run_dir} already has a running platform ({', '.join(running)}); "
                               f"run `rlfleet down --run-dir {self.run_dir}` first")

    def _record(self, record: ProcessRecord) -> None:
        self.state.processes.append(record)
        self.state.save()

    def _tls_dir(self) -> Path:
        """Where the CA that signs NATS's and Redis's certificates is: the one every service trusts."""
        return security.secrets_dir() or security.run_secrets_dir(self.run_dir)

    def _start_nats(self) -> None:
        nats = self.config.nats
        authorization = nats_authorization(ensure_infra_secrets(secrets_dir(self.run_dir)),
                                           run=self.config.run_id)
        server = NatsServer(self.run_dir / "nats", nats.max_payload_bytes, nats.binary,
                            authorization=authorization,
                            tls=security.server_tls_files(self._tls_dir(), "nats"),
                            log_path=self.logs / "nats.log", name="nats", new_session=True,
                            log_lines=1).spawn()
        self._children[server.name] = server
        self._record(record_of(server, kind="nats"))
        url = server.wait_url(self.config.start_timeout_s)
        record = self.state.by_name(server.name)
        record.url, record.address = url, url.split("://", 1)[-1]
        server.write_conf(_port_of(record.address))  # a restart listens where the clients reconnect to
        self.state.save()

    def _start_redis(self) -> None:
        def record(server: RedisServer) -> None:
            # A retry on another port replaces its predecessor's record.
            self.state.processes = [p for p in self.state.processes if p.kind != "redis"]
            self._children[server.name] = server
            self._record(record_of(server, kind="redis", address=f"127.0.0.1:{server.port}", url=server.url))

        secrets = secrets_dir(self.run_dir)
        aclfile = secrets / "redis.acl"  # users and key patterns of this run only; `default` off
        write_secret(aclfile, redis_acl(ensure_infra_secrets(secrets), run=self.config.run_id))
        server = start_redis(self.run_dir / "redis", timeout_s=min(10.0, self.config.start_timeout_s),
                             aclfile=aclfile, before_wait=record, appendonly=True,
                             binary=self.config.redis.binary,
                             tls=security.server_tls_files(self._tls_dir(), "redis"),
                             log_path=self.logs / "redis.log", name="redis", new_session=True, log_lines=1)
        # Revocations made while Redis was down (the file is the record) reach every service from here.
        from rlfleet.common import revocations

        revoked = [t["id"] for t in security.list_tokens(self._tls_dir()) if t["revoked"]]
        revocations.publish_ids(server.url, run_dir_login(self.run_dir, "redis", "operator"),
                                self.config.run_id, revoked)

    def _start_engines(self) -> None:
        """CPU engines, all loading at once, each with its own log, config file and ready file."""
        started = []
        for index in range(self.config.engines):
            name = f"engine-{index}"
            config = self._process_config("cpu-engine", name)
            assert isinstance(config, EngineConfig)
            config.engine_id = name
            started.append(self._spawn(name, "rlfleet-cpu-engine", config, kind="engine"))
        for child, ready in started:
            info = child.wait_for_file(ready, self.config.start_timeout_s)
            record = self.state.by_name(child.name)
            record.url, record.address = info["url"], f"127.0.0.1:{info['port']}"
            _pin_ports(record, {"port": info["port"]})
            self.state.save()

    def _start_services(self, names: list[str]) -> None:
        started = []
        for name in names:
            config = self._process_config(name, name)
            started.append(self._spawn(name, SCRIPTS[name], config))
        for child, ready in started:
            info = child.wait_for_file(ready, self.config.start_timeout_s)
            record = self.state.by_name(child.name)
            record.address, record.metrics_port = info["grpc_address"], info.get("metrics_port", 0)
            pinned = {"grpc": {"port": _port_of(record.address)}}
            if record.metrics_port:
                pinned["metrics"] = {"port": record.metrics_port}
            _pin_ports(record, pinned)
            self.state.save()

    def _process_config(self, process: str, name: str) -> ProcessConfig:
        ready = self.run_dir / "ready" / f"{name}.json"
        ready.unlink(missing_ok=True)
        return process_config(process, self.config, self.state, self.run_dir, ready, self.model)

    def _spawn(self, name: str, script: str, config: ProcessConfig,
               kind: str = "service") -> tuple[ChildProcess, Path]:
        """Writes the process's config file and starts it with `--config`; it is recorded at once, so
        a launch stopped while it starts still stops it."""
        config_file = write_process_config(self.run_dir, name, config)
        child = spawn([find_binary(script), "--config", str(config_file)], self.logs / f"{name}.log", name,
                      env=service_env())
        self._children[name] = child
        self._record(record_of(child, kind=kind))
        return child, Path(config.ready_file)


    # -- supervision -------------------------------------------------------------------------------

    def restart_dead(self, now: float | None = None, wait: bool = True) -> list[str]:
        """Starts again every recorded process that is no longer running and whose backoff has run
        out: NATS and Redis first (everyone else reconnects to them), then the rest. Each restart
        waits for its process to serve on a thread of its own, so one slow start (a trainer loading
        its model) never holds up another. With `wait` it returns once the restarts it began are
        done; without, at once (call it again to collect the outcome). Returns one line per restart
        or failed restart finished since the last call, for the caller to show."""
        if not self.config.restart.enabled or self.stopping():
            return []
        now = time.time() if now is None else now
        waves = ((INFRASTRUCTURE,), (INFRASTRUCTURE, None)) if wait else ((INFRASTRUCTURE, None),)
        for kinds in waves:
            threads = self._start_dead(now, services=None in kinds)
            if wait:
                for thread in threads:
                    thread.join()
        with self._lock:
            events, self._events = self._events, []
        return events

    def _start_dead(self, now: float, services: bool) -> list[threading.Thread]:
        with self._lock:
            dead = [r for r in self.state.processes if r.name not in self._restarting and not is_ours(r)]
            infrastructure_down = any(r.kind in INFRASTRUCTURE for r in dead) or any(
                self.state.by_name(name).kind in INFRASTRUCTURE for name in self._restarting)
            threads = []
            for record in dead:
                if record.kind not in INFRASTRUCTURE and (not services or infrastructure_down):
                    continue  # it would only fail to reach NATS or Redis: after them
                if not self._backoff_over(record, now):
                    continue
                exit_status = self._exit_status(record)
                try:
                    child = self._respawn(record)
                except (OSError, StartupError) as exc:
                    self._events.append(self._failed(record, f"could not start: {exc}"))
                    continue
                record.restarts += 1
                record.last_exit = exit_status
                record.last_restart_unix = now
                self._restarting.add(record.name)
                thread = threading.Thread(target=self._finish_restart, args=(record, child),
                                          name=f"restart-{record.name}", daemon=True)
                threads.append(thread)
            self.state.save()
        for thread in threads:
            thread.start()
        return threads

    def _finish_restart(self, record: ProcessRecord, child: ChildProcess) -> None:
        try:
            self._wait_restarted(record, child)
            how = " from its standby" if child.name in self._promoted else ""
            event = (f"{record.name} restarted{how} ({record.last_exit}; restart {record.restarts}, "
                     f"pid {record.pid})")
            record.ready_unix = time.time()
        except StartupError as exc:
            event = self._failed(record, str(exc))
        with self._lock:
            self._events.append(event)
            self._restarting.discard(record.name)
            self._promoted.discard(record.name)
            self.start_standbys()  # after the restart, so that its imports never slow the one promoted
            self.state.save()

    def stopping(self) -> bool:
        """Whether `rlfleet down` (or this launcher's own `down`) is stopping the platform."""
        return (self.run_dir / STOPPING_FILE).exists()

    def restarting(self) -> bool:
        """Whether a restart is under way (its process started, not serving yet)."""
        with self._lock:
            return bool(self._restarting)

    def _exit_status(self, record: ProcessRecord) -> str:
        return _exit_status(record.pid, self._children.get(record.name))

    def _backoff_over(self, record: ProcessRecord, now: float) -> bool:
        """Bounded exponential backoff between restarts of one process: the first at once, then
        `first_backoff_s` doubling up to `max_backoff_s`; a process that stayed up `stable_after_s`
        since its last restart starts over at once."""
        policy = self.config.restart
        tries, last = self._restart_tries.get(record.name, (0, 0.0))
        if now - last >= policy.stable_after_s:
            tries = 0
        delay = 0.0 if tries == 0 else min(policy.max_backoff_s, policy.first_backoff_s * 2 ** (tries - 1))
        if now - last < delay:
            return False
        self._restart_tries[record.name] = (tries + 1, now)
        return True

    def _failed(self, record: ProcessRecord, why: str) -> str:
        tries, _ = self._restart_tries.get(record.name, (0, 0.0))
        return f"{record.name} did not come back ({why}); try {tries}, trying again with backoff"

    def _respawn(self, record: ProcessRecord) -> ChildProcess:
        """The recorded command line again, in a new session, its output appended to the same log."""
        ready = _ready_file(record)
        if ready is not None:
            ready.unlink(missing_ok=True)  # the one the dead process wrote
        child = self._promote_standby(record) or spawn(record.cmdline, Path(record.log), record.name,
                                                           env=service_env())
        record.pid, record.start_ticks = child.pid, start_ticks(child.pid) or 0
        self._children[record.name] = child
        return child

    def start_standbys(self) -> None:
        """A standby for each service that has one (restart.standby) and has none alive. For the
        launcher that supervises (a detached `rlfleet up` returns, and its standbys would only
        follow it out): `rlfleet run` and a foreground `rlfleet up` call it once the platform serves."""
        if not self.config.restart.enabled or self.stopping():
            return
        for name in self.config.restart.standby:
            if name not in self.config.services or name in self._restarting:
                continue
            current = self._standbys.get(name)
            if current is not None and current.returncode is None:
                continue
            record = self.state.by_name(name)
            child = spawn([*record.cmdline, standby.FLAG], Path(record.log), f"{name}-standby",
                          env=service_env())
            self._standbys[name] = child
            self.state.standbys = [s for s in self.state.standbys if s.name != child.name]
            self.state.standbys.append(record_of(child, kind="standby"))
        self.state.save()

    def _promote_standby(self, record: ProcessRecord) -> ChildProcess | None:
        """The standby of `record`'s service, told to take over; None when none is waiting (one still
        importing is stopped: a cold start is as quick, and its signal would land too early)."""
        child = self._standbys.pop(record.name, None)
        self.state.standbys = [s for s in self.state.standbys if s.name != f"{record.name}-standby"]
        if child is None or child.returncode is not None:
            return None
        ready = _ready_file(record)
        if ready is None or standby.waiting_pid(ready) != child.pid:
            child.kill()
            return None
        try:
            os.kill(child.pid, standby.PROMOTE)
        except ProcessLookupError:
            return None
        child.name = record.name
        self._promoted.add(record.name)
        return child

    def _wait_restarted(self, record: ProcessRecord, child: ChildProcess) -> None:
        timeout = self.config.start_timeout_s
        try:
            if record.kind in ("nats", "redis"):
                wait_until(lambda: port_open(_port_of(record.address)), timeout, record.name, child)
                return
            ready = _ready_file(record)
            info = child.wait_for_file(ready, timeout) if ready is not None else {}
        except StartupError:
            if child.returncode is None:
                child.kill()
            raise
        address = info.get("grpc_address") or (f"127.0.0.1:{info['port']}" if "port" in info else "")
        if address and address != record.address:  # the port was taken meanwhile: its peers would not find it
            child.kill()
            raise StartupError(f"came back on {address}, not on its recorded {record.address}")


def _port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _config_file(record: ProcessRecord) -> Path | None:
    argv = record.cmdline
    return Path(argv[argv.index("--config") + 1]) if "--config" in argv else None


def _ready_file(record: ProcessRecord) -> Path | None:
    config_file = _config_file(record)
    if config_file is None or not config_file.exists():
        return None
    ready = json.loads(config_file.read_text()).get("ready_file")
    return Path(ready) if ready else None


def _pin_ports(record: ProcessRecord, ports: dict[str, Any]) -> None:
    """Writes the ports the process bound into its own config file, so a restart binds them again."""
    config_file = _config_file(record)
    if config_file is None:
        return
    config = json.loads(config_file.read_text())
    for key, value in ports.items():
        if isinstance(value, dict):
            config.setdefault(key, {}).update(value)
        else:
            config[key] = value
    write_json_atomic(config_file, config)


def _exit_status(pid: int, child: ChildProcess | None) -> str:
    """How our child `pid` ended (reaping it), or "unknown" when it was not our child."""
    if child is not None and child.process is not None and child.pid == pid:
        try:  # a process with many threads is not reapable until the last of them is gone
            code = child.process.wait(2.0)
        except subprocess.TimeoutExpired:
            return "unknown"
        return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
    try:
        waited, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return "unknown"
    if waited == 0:
        return "unknown"
    if os.WIFSIGNALED(status):
        return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit {os.WEXITSTATUS(status)}"


def use_run_secrets(run_dir: Path, run_id: str) -> Path:
    """The run's CA, certificates and token key (made on the first start, 0600 in
    `<run_dir>/secrets/`), for this process (the operator) and every process it starts. A secrets
    directory given in RLFLEET_SECRETS_DIR (a test session's) is used instead while the run directory
    has none of its own."""
    given = os.environ.get(security.SECRETS_ENV, "")
    own = security.run_secrets_dir(run_dir)
    if given and Path(given, "ca.key").exists() and not (own / "ca.pem").exists():
        os.environ.pop(security.TOKEN_ENV, None)
        return Path(given)
    directory = security.ensure_secrets(own, run_id)
    os.environ[security.SECRETS_ENV] = str(directory)
    os.environ.pop(security.TOKEN_ENV, None)  # the launcher and its services call as themselves
    return directory


def service_env() -> dict[str, str]:
    env = dict(os.environ)
    # Services share few cores; each keeps its own math libraries to one thread unless told.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env.setdefault(var, "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
