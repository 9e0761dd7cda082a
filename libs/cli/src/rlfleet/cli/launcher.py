"""The local launcher: NATS, Redis and the services as child processes of one run directory.

Everything a launch starts is recorded in `<run_dir>/platform.json` (PID, command line, log file,
address), so `rlfleet down` and `rlfleet status` work from another shell, and stopping never
touches a process that is not ours: a PID is only signalled while its start time still matches the one recorded.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlfleet.cli.platform_config import PlatformConfig
from rlfleet.common.errors import StartupError

STATE_FILE = "platform.json"


@dataclass
class ProcessRecord:
    name: str
    pid: int
    start_ticks: int        # from /proc/<pid>/stat: tells our process from a later one with its PID
    cmdline: list[str]
    log: str
    address: str = ""       # host:port (gRPC for services, client port for NATS/Redis)
    url: str = ""           # nats://, redis://, http://
    metrics_port: int = 0
    kind: str = "service"   # service | nats | redis | engine | worker


@dataclass
class PlatformState:
    run_id: str
    run_dir: str
    launcher_pid: int
    processes: list[ProcessRecord] = field(default_factory=list)
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
        return cls(**data)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def bin_path(name: str) -> str:
    """A console script or binary next to this interpreter (the venv), else from PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise StartupError(f"{name} is not installed (run `make install`)")
    return found


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


def spawn(cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Starts a child in a session of its own (so Ctrl-C in the terminal reaches only the launcher,
    which then stops the children in order), output appended to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, proc: subprocess.Popen | None = None,
             log: Path | None = None) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise StartupError(f"{what} exited with code {proc.returncode}: {last_line(log)}")
        time.sleep(0.05)
    raise StartupError(f"{what} was not ready after {timeout_s:.0f} s: {last_line(log)}")


def last_line(log: Path | None) -> str:
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


def stop_processes(records: list[ProcessRecord], timeout_s: float) -> list[str]:
    """Stops services first and NATS/Redis last (services drain into them), each wave with SIGTERM,
    then SIGKILL for stragglers; returns the names it had to kill."""
    infrastructure = {"nats", "redis"}
    waves = [[r for r in records if r.kind not in infrastructure], [r for r in records if r.kind in infrastructure]]
    killed = []
    for wave in waves:
        killed += _stop_wave([r for r in reversed(wave) if is_ours(r)], timeout_s)
    return killed


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


def service_args(name: str, config: PlatformConfig, state: PlatformState, run_dir: Path,
                 model: Path | None = None) -> list[str]:
    """Peer addresses and data paths each service gets from the launch."""
    nats_url = state.by_name("nats").url
    redis_url = state.by_name("redis").url
    engine_records = [r for r in state.processes if r.kind == "engine"]
    engines = [{"engine_id": r.name, "url": r.url, "pool": "canary" if i < config.canary_engines else "fleet",
                "kind": "cpu"} for i, r in enumerate(engine_records)]
    model_args = ["--set", f"tokenizer_path={model}"] if model is not None else []
    peers: dict[str, list[str]] = {
        "sandbox-manager": ["--redis.url", redis_url, "--root", str(run_dir / "sandboxes")],
        # As --set, so that the same keys in `overrides` (which come later) win.
        "rollout-gateway": ["--redis.url", redis_url, "--set", f"engines={json.dumps(engines)}"],
        "trainer": ["--nats.url", nats_url, "--weight-store", str(run_dir / "weights"),
                    *(["--set", f"model_path={model}"] if model is not None else [])],
        "session-server": ["--nats.url", nats_url, "--redis.url", redis_url,
                           "--gateway-address", _address(state, "rollout-gateway"),
                           *model_args],
        "weight-broker": ["--nats.url", nats_url, "--redis.url", redis_url,
                          "--gateway-address", _address(state, "rollout-gateway"),
                          "--weight-store", str(run_dir / "weights"),
                          # Without canary engines there is no gate to wait for: versions go to the fleet.
                          "--set", f"auto_promote={'false' if config.canary_engines else 'true'}"],
        "verifier": ["--redis.url", redis_url, "--sandbox-address", _address(state, "sandbox-manager"),
                     "--session-address", _address(state, "session-server"),
                     "--suites-dir", str(run_dir / "suites"), *model_args],
    }
    args = ["--run-id", config.run_id, "--log.format", config.log_format, *peers[name]]
    for key, value in flatten_keys(config.overrides.get(name, {})):
        args += ["--set", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
    return args


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
    cmd = [bin_path("rlfleet-build-model"), "--out", str(building), "--seed", str(config.model_seed)]
    proc = spawn(cmd, log, env=_service_env())
    try:
        code = proc.wait(timeout_s)
    except BaseException:  # timeout or Ctrl-C: do not leave the builder running
        proc.kill()
        proc.wait()
        shutil.rmtree(building, ignore_errors=True)
        raise
    if code != 0:
        shutil.rmtree(building, ignore_errors=True)
        raise StartupError(f"building the default model failed (exit {code}): {last_line(log)}")
    try:
        building.rename(target)
    except OSError:  # another launch finished the same build first: use theirs
        shutil.rmtree(building, ignore_errors=True)
    return target


# Services that need another service's address start after it.
TIERS = (("sandbox-manager", "rollout-gateway", "trainer"), ("session-server", "weight-broker"), ("verifier",))
SCRIPTS = {
    "sandbox-manager": "rlfleet-sandbox-manager", "rollout-gateway": "rlfleet-gateway",
    "trainer": "rlfleet-trainer", "session-server": "rlfleet-session-server",
    "weight-broker": "rlfleet-weight-broker", "verifier": "rlfleet-verifier",
}


class Platform:
    """One launch: starts processes in order, records them, stops exactly them."""

    def __init__(self, config: PlatformConfig) -> None:
        unknown = sorted(set(config.services) - set(SCRIPTS))
        if unknown:
            raise StartupError(f"unknown services {unknown}; known: {', '.join(SCRIPTS)}")
        self.config = config
        self.run_dir = run_dir_for(config)
        self.logs = self.run_dir / "logs"
        self.state = PlatformState(config.run_id, str(self.run_dir), os.getpid(),
                                   config=config.model_dump(mode="json"))
        self.model: Path | None = None

    def up(self) -> PlatformState:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._refuse_second_launch()
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
        killed = stop_processes(self.state.processes, self.config.stop_timeout_s)
        self.state.processes = []
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

    def _start_nats(self) -> None:
        binary = self.config.nats.binary or bin_path("nats-server")
        data = self.run_dir / "nats"
        data.mkdir(parents=True, exist_ok=True)
        ports_dir = data / "ports"
        ports_dir.mkdir(exist_ok=True)
        conf = data / "nats.conf"
        conf.write_text(
            "listen: 127.0.0.1:-1\n"
            f"max_payload: {self.config.nats.max_payload_bytes}\n"
            f"ports_file_dir: {json.dumps(str(ports_dir))}\n"
            f"jetstream {{ store_dir: {json.dumps(str(data / 'jetstream'))} }}\n")
        log = self.logs / "nats.log"
        cmd = [binary, "-c", str(conf)]
        proc = spawn(cmd, log)
        self._record(ProcessRecord("nats", proc.pid, start_ticks(proc.pid) or 0, cmd, str(log), kind="nats"))
        ports_file = ports_dir / f"{Path(binary).name}_{proc.pid}.ports"

        def read_port() -> str | None:
            if not ports_file.exists():
                return None
            try:
                client = json.loads(ports_file.read_text())["nats"][0]
            except (json.JSONDecodeError, KeyError, IndexError):
                return None
            return client

        url = wait_for(read_port, self.config.start_timeout_s, "nats-server", proc, log)
        record = self.state.by_name("nats")
        record.url = url
        record.address = url.removeprefix("nats://")
        self.state.save()

    def _start_redis(self) -> None:
        data = self.run_dir / "redis"
        data.mkdir(parents=True, exist_ok=True)
        log = self.logs / "redis.log"
        for _attempt in range(5):
            port = free_port()
            cmd = [bin_path(self.config.redis.binary), "--bind", "127.0.0.1", "--port", str(port),
                   "--dir", str(data), "--save", "", "--appendonly", "yes", "--daemonize", "no",
                   "--protected-mode", "yes"]
            proc = spawn(cmd, log)
            record = ProcessRecord("redis", proc.pid, start_ticks(proc.pid) or 0, cmd, str(log),
                                   address=f"127.0.0.1:{port}", url=f"redis://127.0.0.1:{port}/0", kind="redis")
            self._record(record)
            try:
                wait_for(lambda p=port: _port_open(p), min(10.0, self.config.start_timeout_s), "redis-server",
                         proc, log)
            except StartupError:
                if proc.poll() is None:
                    raise
                self.state.processes.remove(record)  # lost the port between probe and bind: try another
                continue
            return
        raise StartupError(f"redis-server could not bind a port: {last_line(log)}")

    def _start_engines(self) -> None:
        """CPU engines, all loading at once, each with its own log and ready file."""
        started = []
        for index in range(self.config.engines):
            name = f"engine-{index}"
            ready = self.run_dir / "ready" / f"{name}.json"
            ready.unlink(missing_ok=True)
            log = self.logs / f"{name}.log"
            # Version "0": rlfleet's policy versions are integers and the initial weights are version 0.
            cmd = [bin_path("rlfleet-cpu-engine"), "--model-path", str(self.model), "--engine-id", name,
                   "--torch-threads", str(self.config.engine_torch_threads), "--weight-version", "0",
                   "--ready-file", str(ready)]
            # overrides."cpu-engine" (e.g. telemetry.span_file) reach every engine as --set, as a service's do.
            for key, value in flatten_keys(self.config.overrides.get("cpu-engine", {})):
                cmd += ["--set", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
            proc = spawn(cmd, log, env=_service_env())
            self._record(ProcessRecord(name, proc.pid, start_ticks(proc.pid) or 0, cmd, str(log), kind="engine"))
            started.append((name, proc, ready, log))
        for name, proc, ready, log in started:
            info = wait_for(lambda r=ready: _read_json(r), self.config.start_timeout_s, name, proc, log)
            record = self.state.by_name(name)
            record.url = info["url"]
            record.address = f"127.0.0.1:{info['port']}"
            self.state.save()

    def _start_services(self, names: list[str]) -> None:
        started = []
        for name in names:
            ready = self.run_dir / "ready" / f"{name}.json"
            ready.unlink(missing_ok=True)
            log = self.logs / f"{name}.log"
            cmd = [bin_path(SCRIPTS[name]), *service_args(name, self.config, self.state, self.run_dir, self.model),
                   "--ready-file", str(ready)]
            proc = spawn(cmd, log, env=_service_env())
            self._record(ProcessRecord(name, proc.pid, start_ticks(proc.pid) or 0, cmd, str(log)))
            started.append((name, proc, ready, log))
        for name, proc, ready, log in started:
            info = wait_for(lambda r=ready: _read_json(r), self.config.start_timeout_s, name, proc, log)
            record = self.state.by_name(name)
            record.address = info["grpc_address"]
            record.metrics_port = info.get("metrics_port", 0)
            self.state.save()


def _service_env() -> dict[str, str]:
    env = dict(os.environ)
    # Services share few cores; each keeps its own math libraries to one thread unless told.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env.setdefault(var, "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0
