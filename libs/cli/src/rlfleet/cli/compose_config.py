"""`rlfleet compose-config`: the config files of a docker compose stack, written as `rlfleet up` writes
them (deploy/compose/compose.yaml mounts them).

    rlfleet compose-config --out runs/compose [--config deploy/compose/rlfleet.toml] [--port-base N]
                           [--tasks N] [--run-config deploy/compose/run.toml]
                           [KEY OVERRIDES as for rlfleet up]

The launch config is `rlfleet up`'s (`PlatformConfig`, the same TOML and flags). Each process's file
`<out>/config/<process>.json` is made by the launcher's own `process_config`, from a launch state in
which every process listens on 127.0.0.1 at a port chosen here: the containers use host networking,
bound to loopback, so nothing leaves 127.0.0.0/8 and peers are addressed as under `rlfleet up`.
Paths are the containers' (`/var/lib/rlfleet/run` is the run directory, `/models/policy` the model),
backed by compose volumes. `<out>/compose.env` holds the ports and the run's few other values for
compose's variable substitution (`docker-compose --env-file`).

The run: `--run-config` (a run config, `rlfleet run`'s TOML; deploy/compose/run.toml by default) is
checked here and written to `<out>/config/run.toml`, and the controller's `start_run` names it, so
the controller drives that run (task feed, evaluations, promotion gate, canary) from its start, as
`rlfleet run` drives one on `rlfleet up`'s platform. Two engines, as `rlfleet run` launches them: the
canary (rollouts and the gate's candidates) and the fleet (the accepted version).

NATS and Redis users (rlfleet.common.infra_auth) and the gRPC trust material (rlfleet.common.security:
the run's CA, every service's certificate, the token key, the engines' api keys, the workers' token)
are made once in `<out>/secrets/` (0600, owned by the containers' uid when this runs as root): compose
mounts each service's own password file and certificate as secrets, NATS's authorization block and
Redis's ACL file into those two. The CA key is mounted nowhere.

Ports are free ones (`free_port`) unless `--port-base N` asks for N, N+1, ... (fixed, e.g. to reach
the stack's Prometheus metrics from elsewhere); either way none is NATS's 4222 or Redis's 6379.

    python -m rlfleet.cli.compose_config build-model OUT SEED

builds the default model into OUT (the stack's model-init job) as the launcher does.

    python -m rlfleet.cli.compose_config secrets OUT [RUN_ID]

writes the same NATS/Redis secrets for Kubernetes, to load as the `rlfleet-infra-auth` Secret;
deploy/k8s/make_secrets.py renders it and the gRPC material's `rlfleet-tls` as manifests.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from pydantic import ValidationError

from rlfleet.cli.launcher import PlatformState, ProcessRecord, process_config, write_process_config
from rlfleet.cli.platform_config import ALL_SERVICES, ControllerConfig, EngineConfig, PlatformConfig
from rlfleet.cli.run_config import RunConfig
from rlfleet.common import security
from rlfleet.common.config import ServiceConfig, format_validation_error, load_config
from rlfleet.common.errors import StartupError
from rlfleet.common.infra_auth import ensure_infra_secrets, nats_authorization, redis_acl, write_secret
from rlfleet.common.processes import free_port, write_json_atomic
from rlfleet.envkit.worker_config import WorkerConfig

RUN_DIR = Path("/var/lib/rlfleet/run")   # the run directory inside every container
SECRETS_MOUNT = "/run/secrets"           # where compose mounts a service's secrets
CONTAINER_UID = 10001                    # deploy/docker/Dockerfile's RLFLEET_UID
MODEL = Path("/models/policy")           # the model volume's policy
# The canary engine first, then the fleet's (`canary_engines = 1` in deploy/compose/rlfleet.toml).
ENGINES = ("engine-0", "engine-1")
RUN_TOML = "run.toml"  # the controller's start_run, beside the processes' configs
# Every port the stack listens on; `<name>` gRPC (or client) port, `<name>-metrics` Prometheus.
PORTS = ("nats", "nats-monitor", "redis", *ENGINES, *(f"{e}-metrics" for e in ENGINES),
         *ALL_SERVICES, *(f"{s}-metrics" for s in ALL_SERVICES), "worker-metrics")
RESERVED = {4222, 6379, 8222}  # the host's own NATS/Redis (and NATS monitoring) defaults
# The gRPC identity (rlfleet.common.security) of each service's container: its entry point's name.
IDENTITIES = {"rollout-gateway": "gateway", "session-server": "session-server",
              "sandbox-manager": "sandbox-manager", "verifier": "verifier", "trainer": "trainer",
              "weight-broker": "weight-broker",
              "controller": "controller"}
WORKER_CLIENT = "worker"  # the rollout workers' environment-client name (a token, no certificate)


def choose_ports(port_base: int | None) -> dict[str, int]:
    if port_base is not None:
        ports: dict[str, int] = {name: port_base + i for i, name in enumerate(PORTS)}
        clash = RESERVED & set(ports.values())
        if clash:
            raise StartupError(f"--port-base {port_base} would use {sorted(clash)} (the host's NATS/Redis)")
        return ports
    ports = {}
    while len(ports) < len(PORTS):
        port = free_port()
        if port not in RESERVED and port not in ports.values():
            ports[PORTS[len(ports)]] = port
    return ports


def launch_state(config: PlatformConfig, ports: dict[str, int]) -> PlatformState:
    """What `rlfleet up` would have recorded had it started everything on these ports."""
    def record(name: str, kind: str, address: str, url: str = "") -> ProcessRecord:
        return ProcessRecord(name, 0, 0, [], "", kind=kind, address=address, url=url)

    processes = [
        # TLS only, as under `rlfleet up` (certs/nats.pem, certs/redis.pem: write_tls_secrets)
        record("nats", "nats", address=f"127.0.0.1:{ports['nats']}", url=f"tls://127.0.0.1:{ports['nats']}"),
        record("redis", "redis", address=f"127.0.0.1:{ports['redis']}",
               url=f"rediss://127.0.0.1:{ports['redis']}/0"),
        *(record(e, "engine", address=f"127.0.0.1:{ports[e]}", url=f"http://127.0.0.1:{ports[e]}")
          for e in ENGINES),
        *(record(name, "service", address=f"127.0.0.1:{ports[name]}") for name in config.services),
    ]
    return PlatformState(config.run_id, str(RUN_DIR), 0, processes)


def prometheus_config(ports: dict[str, int]) -> str:
    """Prometheus's scrape config: one job per process with metrics, its loopback port."""
    jobs: list[tuple[str, str]] = []
    lines = ["# Written by `rlfleet compose-config`: every metrics endpoint of the compose stack (loopback).",
             "global:", "  scrape_interval: 15s", "  evaluation_interval: 15s", "scrape_configs:"]
    for name in (*ALL_SERVICES, "worker"):
        jobs.append((name, str(ports[f"{name}-metrics"])))
    for job, port in jobs:
        lines += [f"  - job_name: {job}", "    static_configs:", f"      - targets: [\"127.0.0.1:{port}\"]"]
    return "\n".join(lines) + "\n"


def checked_run(config: PlatformConfig, text: str, where: str) -> RunConfig:
    """The run the controller starts, refused here rather than in a container's log: its run_id is
    the stack's, its run directory the controller's, its groups the trainer's size."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise StartupError(f"{where}: {exc}") from None
    data.setdefault("run_id", config.run_id)
    if data.get("run_dir", str(RUN_DIR)) != str(RUN_DIR):
        raise StartupError(f"{where}: run_dir must be left out (the controller's is {RUN_DIR})")
    data["run_dir"] = str(RUN_DIR)
    try:
        run = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise StartupError(f"{where}: {format_validation_error(exc)}") from None
    if run.run_id != config.run_id:
        raise StartupError(f"{where}: run_id {run.run_id!r} is not the stack's ({config.run_id!r})")
    if run.group_size != config.trainer.group_size:
        raise StartupError(f"{where}: group_size {run.group_size} is not the trainer's "
                           f"({config.trainer.group_size})")
    return run


def write_stack(config: PlatformConfig, out: Path, ports: dict[str, int], tasks: int,
                project: str = "rlfleet", run_config: Path | None = None) -> dict[str, str]:
    """Writes every process's config, prometheus.yml and compose.env; returns compose.env's values.
    `run_config`: the run the controller starts (checked, copied to config/run.toml); None: none,
    the controller waits for StartRun."""
    if sorted(config.services) != sorted(ALL_SERVICES):
        raise StartupError(f"the compose stack runs every service ({', '.join(ALL_SERVICES)}); "
                           f"this config lists {config.services}")
    if config.engines != len(ENGINES) or config.canary_engines != 1 or config.candidate_engines:
        raise StartupError("the compose stack runs two CPU engines, a canary and the fleet "
                           "(engines = 2, canary_engines = 1)")
    if config.model_path:
        raise StartupError("the compose stack serves the default model (model_path must be empty)")
    state = launch_state(config, ports)
    write_secrets(out / "secrets", config.run_id)
    start_run = ""
    if run_config is not None:
        text = run_config.read_text()
        checked_run(config, text, str(run_config))
        (out / "config").mkdir(parents=True, exist_ok=True)
        (out / "config" / RUN_TOML).write_text(text)
        start_run = str(RUN_DIR / "config" / RUN_TOML)
    for name in (*ENGINES, *ALL_SERVICES):
        process = "cpu-engine" if name in ENGINES else name
        section = process_config(process, config, state, RUN_DIR, Path(f"/tmp/ready-{name}.json"), MODEL)
        for peer in ("nats", "redis"):  # compose mounts each password file as a secret
            login = getattr(section, peer, None)
            if login is not None and login.password_file:
                login.password_file = f"{SECRETS_MOUNT}/{Path(login.password_file).name}"
        section.metrics.host, section.metrics.port = "127.0.0.1", ports[f"{name}-metrics"]
        if isinstance(section, EngineConfig):
            section.host, section.port, section.engine_id = "127.0.0.1", ports[name], name
        else:
            assert isinstance(section, ServiceConfig), process
            section.grpc.host, section.grpc.port = "127.0.0.1", ports[name]
        if isinstance(section, ControllerConfig):
            section.trainer_metrics_url = f"http://127.0.0.1:{ports['trainer-metrics']}/metrics"
            section.start_run = start_run
        write_process_config(out, name, section)
    worker = WorkerConfig(run_id=config.run_id,
                          nats={"url": state.by_name("nats").url, "user": "worker",
                                "password_file": f"{SECRETS_MOUNT}/nats-worker.password"},
                          session_address=state.by_name("session-server").address,
                          sandbox_address=state.by_name("sandbox-manager").address,
                          verifier_address=state.by_name("verifier").address,
                          # an environment client: the run's CA and its own token, both compose secrets
                          token_file=f"{SECRETS_MOUNT}/worker.token", ca_file=f"{SECRETS_MOUNT}/ca.pem",
                          default_group_size=config.trainer.group_size,
                          metrics={"host": "127.0.0.1", "port": ports["worker-metrics"]},
                          log={"format": config.log_format})
    write_process_config(out, "worker", worker)
    (out / "prometheus.yml").write_text(prometheus_config(ports))
    env = {"COMPOSE_PROJECT_NAME": project, "RLFLEET_IMAGE": os.environ.get("RLFLEET_IMAGE", "rlfleet:dev"),
           "RLFLEET_PROMETHEUS_CONFIG": str((out / "prometheus.yml").resolve()),
           "PROMETHEUS_PORT": os.environ.get("PROMETHEUS_PORT", "9090"),
           "GRAFANA_PORT": os.environ.get("GRAFANA_PORT", "3000"),
           "RLFLEET_RUN_ID": config.run_id, "RLFLEET_CONFIG_DIR": str((out / "config").resolve()),
           # Not RLFLEET_SECRETS_DIR: that names a process's own secrets (rlfleet.common.security), and a
           # shell's value would win over this file in compose's substitution.
           "RLFLEET_COMPOSE_SECRETS_DIR": str((out / "secrets").resolve()),
           "RLFLEET_MODEL_SEED": str(config.model_seed), "RLFLEET_GROUP_SIZE": str(config.trainer.group_size),
           "RLFLEET_TASKS": str(tasks), "RLFLEET_NATS_MAX_PAYLOAD": str(config.nats.max_payload_bytes),
           **{f"RLFLEET_PORT_{name.upper().replace('-', '_')}": str(port) for name, port in ports.items()}}
    write_json_atomic(out / "ports.json", ports)
    (out / "compose.env").write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    return env


def write_secrets(directory: Path, run_id: str, container_uid: int | None = CONTAINER_UID) -> None:
    """The stack's NATS and Redis users (rlfleet.common.infra_auth), made once and kept: a password
    per user, NATS's `authorization` block (nats-auth.conf, included by the compose and Kubernetes
    nats.conf) and Redis's ACL file; for compose (`container_uid`) also the gRPC material
    (`write_tls_secrets`), all readable by the containers' uid only.
    Kubernetes takes the same files as the rlfleet-infra-auth Secret (`secrets` below)."""
    infra = ensure_infra_secrets(directory)
    write_secret(directory / "nats-auth.conf", nats_authorization(infra, run=run_id))
    write_secret(directory / "redis.acl", redis_acl(infra, run=run_id))
    if container_uid is None:  # Kubernetes: deploy/k8s/make_secrets.py adds the gRPC material itself
        return
    write_tls_secrets(directory, run_id)
    uid = int(os.environ.get("RLFLEET_UID", container_uid))
    files = [directory, *directory.rglob("*")]
    if os.geteuid() == 0:
        for path in files:
            os.chown(path, uid, uid)
    elif os.geteuid() != uid:
        # The containers run as `uid` (deploy/docker/Dockerfile) and could not read 0600 files of
        # another user: readable by all instead, which a developer's single-user machine tolerates.
        print(f"rlfleet compose-config: warning: {directory} made readable by every local user (run as root, "
              f"or build the image with RLFLEET_UID={os.geteuid()}, to keep it 0600)", file=sys.stderr)
        for path in files:
            path.chmod(0o755 if path.is_dir() else 0o644)


def write_tls_secrets(directory: Path, run_id: str) -> None:
    """The gRPC trust material, made once and kept, with rlfleet.common.security's own functions: the
    run's CA, token key and engine keys, every service identity's certificate (certs/<identity>.pem, made
    here so that no container needs the CA key) and the workers' environment-client token (worker.token).
    Each container gets the CA certificate, the token key and its own certificate; the CA key stays here."""
    security.ensure_secrets(directory, run_id)
    for identity in (*IDENTITIES.values(), *security.INFRA_IDENTITIES):  # NATS and Redis serve TLS too
        security.identity_pem(directory, identity)
    if not (directory / "worker.token").exists():
        token, _ = security.issue_token(directory, run_id, WORKER_CLIENT)
        write_secret(directory / "worker.token", token)


def build_model(out: Path, seed: int) -> int:
    """The default model into `out` once (the model-init job), through a temporary directory renamed
    into place, as the launcher builds it."""
    from rlfleet.cli.warm_start import build_model_command

    if (out / "model.safetensors").exists():
        print(f"model present in {out}")
        return 0
    building = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(building, ignore_errors=True)
    code = subprocess.run(build_model_command(building, seed)).returncode
    if code != 0:
        shutil.rmtree(building, ignore_errors=True)
        return code
    building.rename(out)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["build-model"]:
        return build_model(Path(argv[1]), int(argv[2]))
    if argv[:1] == ["secrets"]:  # for Kubernetes: python -m rlfleet.cli.compose_config secrets OUT [RUN_ID]
        out = Path(argv[1])
        write_secrets(out, argv[2] if len(argv) > 2 else "rlfleet", container_uid=None)
        print(f"wrote {out}; then: kubectl -n rlfleet create secret generic "
              f"rlfleet-infra-auth --from-file={out}")
        return 0
    parser = argparse.ArgumentParser(prog="rlfleet compose-config", add_help=False)
    parser.add_argument("--out", default="runs/compose",
                        help="where config/, compose.env go (default runs/compose)")
    parser.add_argument("--port-base", type=int, help="consecutive ports from here (default: free ones)")
    parser.add_argument("--project", default="rlfleet", help="compose project name (default rlfleet)")
    parser.add_argument("--tasks", type=int, default=200,
                        help="calc tasks the submit job publishes (default 200)")
    parser.add_argument("--run-config", default="deploy/compose/run.toml",
                        help="the run the controller drives from its start (default deploy/compose/run.toml; "
                        "'' for none: the controller waits for StartRun)")
    known, rest = parser.parse_known_args(argv)
    config = load_config(PlatformConfig, rest, prog="rlfleet compose-config",
                         description="Config files of the docker compose stack, as `rlfleet up` writes them. "
                         "Also: --out DIR, --port-base N, --tasks N.")
    out = Path(known.out)
    env = write_stack(config, out, choose_ports(known.port_base), known.tasks, known.project,
                      Path(known.run_config) if known.run_config else None)
    print(f"wrote {out / 'config'} and {out / 'compose.env'} (run {env['RLFLEET_RUN_ID']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
