"""deploy/compose/compose.yaml: checked as a file, then built and brought up for real.

The static tests need no Docker engine. `test_the_stack_trains_and_compose_restarts_a_killed_container`
builds the one image (deploy/docker/build.sh), generates the config as `make compose-up` does (free
ports), brings the stack up with this machine's docker-compose, sees versions advance and trajectories
trained, kills a container's process and sees compose restart it and the loop go on, waits for the
controller's run (deploy/compose/run.toml) to reach a promotion-gate decision, then brings it
down and checks that nothing of its own is left (the cached base and deps images excepted). It skips,
saying why, only when no Docker engine answers (scripts/install.sh starts dockerd where it can).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import deploy_helpers as h
import pytest
import yaml

from rlfleet.cli.compose_config import ENGINES, IDENTITIES, RESERVED, checked_run, write_stack
from rlfleet.cli.compose_config import choose_ports as compose_ports
from rlfleet.cli.platform_config import ALL_SERVICES, PlatformConfig
from rlfleet.common.config import read_toml
from rlfleet.common.security import split_pem

STACK_TOML = h.COMPOSE_FILE.parent / "rlfleet.toml"
RUN_TOML = h.COMPOSE_FILE.parent / "run.toml"   # the run the stack's controller drives
JOBS = {"model-init", "submit"}
UPSTREAM = {"prometheus", "grafana"}   # the observability profile: upstream images, not ours
CONFIG_MOUNT = "/var/lib/rlfleet/run/config"


def stack_config() -> PlatformConfig:
    return PlatformConfig(**read_toml(str(STACK_TOML)))


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> tuple[Path, dict[str, str], dict[str, int]]:
    out = tmp_path_factory.mktemp("compose")
    ports = compose_ports(None)
    env = write_stack(stack_config(), out, ports, tasks=50, run_config=RUN_TOML)
    return out, env, ports


def ours(compose: dict) -> dict[str, dict]:
    return {name: s for name, s in compose["services"].items() if name not in UPSTREAM}


def interpolated(compose_env: dict[str, str]) -> dict:
    """compose.yaml as docker-compose reads it with this env file (`config` output)."""
    docker_compose = h.tool("docker-compose")
    if docker_compose is None:
        pytest.skip("docker-compose is not installed (Debian: apt-get install docker-compose)")
    env_file = Path(compose_env["RLFLEET_CONFIG_DIR"]).parent / "compose.env"
    result = subprocess.run([docker_compose, "--env-file", str(env_file), "-f",
                             str(h.COMPOSE_FILE), "config"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


# -- the file -----------------------------------------------------------------------------------


def test_docker_compose_accepts_the_file_with_its_defaults_and_with_a_generated_env(generated):
    docker_compose = h.tool("docker-compose")
    if docker_compose is None:
        pytest.skip("docker-compose is not installed (Debian: apt-get install docker-compose)")
    result = subprocess.run([docker_compose, "-f", str(h.COMPOSE_FILE), "config", "--quiet"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    interpolated(generated[1])


def test_every_variable_has_a_default_or_is_generated(compose, generated):
    used = set(re.findall(r"\$\{(\w+)(:-[^}]*)?\}", h.COMPOSE_FILE.read_text()))
    env = dict(line.split("=", 1) for line in (h.COMPOSE_FILE.parent / ".env").read_text().splitlines()
               if line and not line.startswith("#"))
    assert env["COMPOSE_PROJECT_NAME"] == "rlfleet"
    for name, default in used:
        assert default or name in env, f"${{{name}}} has neither a default nor a value in .env"
        if name.startswith("RLFLEET_PORT_") or name in ("RLFLEET_CONFIG_DIR", "RLFLEET_RUN_ID"):
            assert name in generated[1], f"compose-config does not write {name}"


def test_one_image_host_networking_restart_policies_and_health_checks(compose):
    for name, service in ours(compose).items():
        assert service["image"] == "${RLFLEET_IMAGE:-rlfleet:dev}", name
        assert service["network_mode"] == "host", name
        assert "ports" not in service, f"{name}: host networking publishes nothing"
        if name in JOBS:
            assert service["restart"] in ("no", "on-failure"), name
            continue
        assert service["restart"] == "unless-stopped", name
        assert service["healthcheck"]["test"][:2] == ["CMD", "rlfleet-healthcheck"] or name == "redis", name


def test_each_process_runs_with_the_config_file_rlfleet_up_would_write(compose, generated):
    out, _, _ = generated
    written = {p.stem for p in (out / "config").glob("*.json")}
    assert written == {*ENGINES, *ALL_SERVICES, "worker"}
    run_by_config = {}
    for name, service in ours(compose).items():
        command = service["command"]
        if "--config" in command:
            path = command[command.index("--config") + 1]
            assert path == f"{CONFIG_MOUNT}/{name}.json", name
            assert any(str(v).endswith(f":{CONFIG_MOUNT}:ro") for v in service["volumes"]), name
            run_by_config[name] = command[0]
    assert set(run_by_config) == written
    scripts = h.console_scripts()
    assert all(program in scripts for program in run_by_config.values()), run_by_config


def test_generated_configs_bind_loopback_on_distinct_ports_and_name_their_peers(generated):
    from rlfleet.common.config import resolve

    out, _, ports = generated
    assert len(set(ports.values())) == len(ports) and not RESERVED & set(ports.values())
    models = dict(h.CONFIG_MODELS)
    for engine in ENGINES:
        models[engine] = ("rlfleet.engine.config", "EngineConfig")
    import importlib

    for name, (module, attribute) in models.items():
        data = json.loads((out / "config" / f"{name}.json").read_text())
        config = resolve(getattr(importlib.import_module(module), attribute), data, {}, {})
        assert config.metrics.host == "127.0.0.1" and config.metrics.port == ports[f"{name}-metrics"], name
        if name in ENGINES:
            assert (config.host, config.port, config.engine_id) == ("127.0.0.1", ports[name], name)
            continue
        if name != "worker":
            assert (config.grpc.host, config.grpc.port) == ("127.0.0.1", ports[name]), name
        assert config.run_id == "compose", name
        for key, value in data.items():
            if key.endswith("_address") and value:
                peer = key.removesuffix("_address").replace("_", "-")
                peer = {"session": "session-server", "sandbox": "sandbox-manager",
                        "gateway": "rollout-gateway", "broker": "weight-broker"}.get(peer, peer)
                assert value == f"127.0.0.1:{ports[peer]}", f"{name}.{key}"
    gateway = json.loads((out / "config" / "rollout-gateway.json").read_text())
    assert [(e["url"], e["pool"]) for e in gateway["engines"]] == [
        (f"http://127.0.0.1:{ports['engine-0']}", "canary"),
        (f"http://127.0.0.1:{ports['engine-1']}", "fleet")]
    broker = json.loads((out / "config" / "weight-broker.json").read_text())
    assert broker["auto_promote"] is False, "with a canary, only the controller's gate promotes"
    trainer = json.loads((out / "config" / "trainer.json").read_text())
    assert trainer["nats"]["url"] == f"tls://127.0.0.1:{ports['nats']}"  # NATS and Redis: TLS only
    session = json.loads((out / "config" / "session-server.json").read_text())
    assert session["redis"]["url"] == f"rediss://127.0.0.1:{ports['redis']}/0"
    assert (trainer["weight_store"] == "/var/lib/rlfleet/run/weights"
            and trainer["model_path"] == "/models/policy")


def test_volumes_for_nats_redis_the_weight_store_and_checkpoints(compose):
    def mounts(name):
        return {v.split(":")[1]: v.split(":")[0]
                for v in compose["services"][name].get("volumes", []) if ":" in v}

    assert mounts("nats")["/data"] == "nats-data" and "-sd" in compose["services"]["nats"]["command"]
    assert (mounts("redis")["/data"] == "redis-data"
            and "--appendonly" in compose["services"]["redis"]["command"])
    for name in ("trainer", "weight-broker", *ENGINES):
        assert mounts(name)["/var/lib/rlfleet/run/weights"] == "weights", name
    assert mounts("trainer")["/var/lib/rlfleet/run/checkpoints"] == "checkpoints"
    for name in ("trainer", "session-server", *ENGINES, "model-init"):
        assert mounts(name)["/models"] == "models", name
    assert mounts("verifier")["/var/lib/rlfleet/run/suites"] == "suites"
    assert mounts("submit")["/var/lib/rlfleet/run/suites"] == "suites"
    assert set(compose["volumes"]) >= {"nats-data", "redis-data", "weights", "models", "suites",
                                       "checkpoints"}


def test_infrastructure_binds_loopback_on_generated_ports(compose):
    nats = compose["services"]["nats"]["command"]
    assert nats[nats.index("-a") + 1] == "127.0.0.1" and "-js" in nats
    assert re.search(r"^max_payload:\s*8MB", (h.COMPOSE_FILE.parent / "nats.conf").read_text(), re.M)
    redis = compose["services"]["redis"]["command"]
    assert redis[redis.index("--bind") + 1] == "127.0.0.1"


def test_dependencies_wait_for_health_or_completion(compose):
    services = compose["services"]
    for name, service in ours(compose).items():
        for target, condition in service.get("depends_on", {}).items():
            wanted = condition["condition"]
            if target in JOBS:
                assert wanted == "service_completed_successfully", f"{name} -> {target}"
            else:
                assert wanted == "service_healthy", f"{name} -> {target}"
                assert "healthcheck" in services[target], \
                    f"{name} waits for {target}, which has no healthcheck"


def test_the_sandbox_manager_gets_what_bubblewrap_needs_and_a_root_per_replica(compose):
    service = compose["services"]["sandbox-manager"]
    assert service["user"] == "0:0" and service["cap_add"] == ["SYS_ADMIN", "NET_ADMIN"]
    assert set(service["security_opt"]) == {"seccomp=unconfined", "apparmor=unconfined"}
    others = {name for name, s in compose["services"].items() if s.get("cap_add") or s.get("user") == "0:0"}
    assert others == {"sandbox-manager"}, "only the sandbox manager runs as root"
    assert "/var/lib/rlfleet/run/sandboxes" in service["volumes"], "anonymous volume: one per replica"
    # The host-wide uid leases: the same host directory in every manager (default driver.uid_lease_dir).
    assert "/run/rlfleet/sandbox-uids:/run/rlfleet/sandbox-uids" in service["volumes"]


def test_nats_server_accepts_the_config_with_the_generated_users(generated, tmp_path):
    nats = h.tool("nats-server") or (str(h.ROOT / ".venv/bin/nats-server")
                                     if (h.ROOT / ".venv/bin/nats-server").exists() else None)
    if nats is None:
        pytest.skip("nats-server is not installed")
    out, _, _ = generated
    (tmp_path / "nats.conf").write_text((h.COMPOSE_FILE.parent / "nats.conf").read_text())
    (tmp_path / "auth.conf").write_text((out / "secrets" / "nats-auth.conf").read_text())  # as mounted
    result = subprocess.run([nats, "-t", "-c", str(tmp_path / "nats.conf")],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    assert '"user": "session-server"' in (tmp_path / "auth.conf").read_text()


def test_only_the_stack_s_controller_may_touch_the_run_state(generated):
    """The run's state (JetStream KV RLFLEET_RUNS): the controller's user gets its run's keys, nobody
    else any."""
    out, env, _ = generated
    text = (out / "secrets" / "nats-auth.conf").read_text()
    listed = json.loads(text.split("authorization", 1)[1])["users"]
    users = {u["user"]: u.get("permissions", {}) for u in listed}
    touching = {name for name, p in users.items() if "RLFLEET_RUNS" in json.dumps(p)}
    assert touching == {"controller"}
    assert f"$KV.RLFLEET_RUNS.{env['RLFLEET_RUN_ID']}.>" in users["controller"]["publish"]["allow"]


def mounted_secrets(service: dict) -> dict[str, str]:
    """{path under /run/secrets: compose secret} of one container (short and long syntax)."""
    found = {}
    for item in service.get("secrets", []):
        source, target = ((item, item) if isinstance(item, str)
                          else (item["source"], item.get("target") or item["source"]))
        found[target] = source
    return found


def test_each_container_gets_only_its_own_secrets_and_redis_needs_a_password(compose, generated):
    out, _, _ = generated
    wanted = {"nats": set(), "redis": {"redis.acl", "redis.pem"}, "submit": {"nats-operator.password"},
              "rollout-gateway": {"redis-rollout-gateway.password"},
              "session-server": {"nats-session-server.password", "redis-session-server.password"},
              "sandbox-manager": {"redis-sandbox-manager.password"}, "verifier": {"redis-verifier.password"},
              "worker": {"nats-worker.password"}, "trainer": {"nats-trainer.password"},
              "weight-broker": {"nats-weight-broker.password", "redis-weight-broker.password"}}
    for name, secrets in wanted.items():
        infra = {s for s in mounted_secrets(compose["services"][name]).values()
                 if s.startswith(("nats-", "redis"))}
        assert infra == secrets, name
    assert not compose["services"]["model-init"].get("secrets")
    redis = compose["services"]["redis"]["command"]
    assert redis[redis.index("--aclfile") + 1] == "/run/secrets/redis.acl"
    assert redis[redis.index("--protected-mode") + 1] == "yes"
    assert "user default off" in (out / "secrets" / "redis.acl").read_text()
    for path in (out / "secrets").rglob("*"):
        assert path.stat().st_mode & 0o077 == 0 or os.geteuid() != 0, path  # 0600 where it can be
    for process in ("trainer", "session-server", "worker"):
        config = json.loads((out / "config" / f"{process}.json").read_text())
        assert config["nats"]["password_file"] == f"/run/secrets/nats-{process}.password"
        assert config["nats"]["password"] == ""
    assert not re.search(r"protected-mode\W+no", h.COMPOSE_FILE.read_text())


def test_nats_and_redis_serve_tls_only_with_the_runs_certificates(compose, generated):
    out, _, _ = generated
    nats = compose["services"]["nats"]
    command = nats["command"]
    assert "--tls" in command and command[command.index("--tlscert") + 1] == "/run/secrets/nats.pem"
    assert command[command.index("--tlscacert") + 1] == "/run/secrets/ca.pem"
    assert set(mounted_secrets(nats).values()) == {"nats.pem", "ca.pem"}
    redis = compose["services"]["redis"]["command"]
    assert redis[redis.index("--port") + 1] == "0", "no plaintext listener"
    assert redis[redis.index("--tls-auth-clients") + 1] == "yes"
    assert redis[redis.index("--tls-cert-file") + 1] == "/run/secrets/redis.pem"
    for name in ("nats", "redis"):  # made by compose-config, from the run's CA, for serving only
        text = subprocess.run(["openssl", "x509", "-noout", "-text", "-in",
                               str(out / "secrets" / "certs" / f"{name}.pem")],
                              capture_output=True, text=True, check=True).stdout
        assert "TLS Web Server Authentication" in text and "Client Authentication" not in text, name
    submit = compose["services"]["submit"]
    assert submit["environment"]["RLFLEET_CA_FILE"] == "/run/secrets/ca.pem"
    assert any(arg.startswith("tls://") for arg in submit["command"])


def test_every_grpc_container_gets_its_own_certificate_and_the_ca_and_none_the_ca_key(compose, generated):
    """The servers are TLS-only (mutual TLS between services): each gRPC service's container has the
    run's CA certificate, the token key and exactly its own identity's certificate, signed by that CA, in
    the secrets directory security.py reads there; the worker (an environment client) the CA and a token."""
    out, env, _ = generated
    secrets_dir = out / "secrets"
    default = "${RLFLEET_COMPOSE_SECRETS_DIR:-../../runs/compose/secrets}"
    for name, identity in IDENTITIES.items():
        service = compose["services"][name]
        assert service["environment"]["RLFLEET_SECRETS_DIR"] == "/run/secrets", name
        mounted = mounted_secrets(service)
        assert mounted["ca.pem"] == "ca.pem" and mounted["token.key"] == "token.key", name
        assert [t for t in mounted if t.startswith("certs/")] == [f"certs/{identity}.pem"], name
        source = Path(compose["secrets"][mounted[f"certs/{identity}.pem"]]["file"].replace(
            default, env["RLFLEET_COMPOSE_SECRETS_DIR"]))
        assert source == secrets_dir.resolve() / "certs" / f"{identity}.pem", name
        _, cert = split_pem(source.read_bytes())
        check = subprocess.run(["openssl", "verify", "-CAfile", str(secrets_dir / "ca.pem")], input=cert,
                               capture_output=True, timeout=30)
        assert check.returncode == 0, (name, check.stderr)
        subject = subprocess.run(["openssl", "x509", "-noout", "-subject"], input=cert, capture_output=True,
                                 timeout=30).stdout.decode()
        assert f"CN = {identity}" in subject or f"CN={identity}" in subject, (name, subject)
    for name in ("rollout-gateway", "weight-broker", *ENGINES):  # they call or are engines: SGLang's keys
        assert ({"engine_api_key", "engine_admin_api_key"}
                <= set(mounted_secrets(compose["services"][name]))), name
    worker = compose["services"]["worker"]
    assert {"ca.pem", "worker.token"} <= set(mounted_secrets(worker))
    config = json.loads((out / "config" / "worker.json").read_text())
    assert (config["token_file"], config["ca_file"]) == ("/run/secrets/worker.token", "/run/secrets/ca.pem")
    assert config["token"] == ""
    assert not any(s["file"].endswith("ca.key") for s in compose["secrets"].values())
    assert "ca.key" not in h.COMPOSE_FILE.read_text()
    # Every one of our containers whose command is a gRPC service is in IDENTITIES.
    for name, service in ours(compose).items():
        command = " ".join(service.get("command", []))
        if any(f"rlfleet-{process} " in command for process in IDENTITIES.values()):
            assert name in IDENTITIES, name


def test_the_controller_starts_the_gated_run_and_owns_the_task_feed(compose, generated):
    out, _, _ = generated
    controller = json.loads((out / "config" / "controller.json").read_text())
    assert controller["start_run"] == f"{CONFIG_MOUNT}/run.toml"
    assert (out / "config" / "run.toml").read_text() == RUN_TOML.read_text()
    run = checked_run(stack_config(), RUN_TOML.read_text(), str(RUN_TOML))
    assert run.gate.enabled and run.run_id == "compose" and run.run_dir == "/var/lib/rlfleet/run"
    # One feeder: the submit job only on request (its profile), never beside the controller's run.
    assert compose["services"]["submit"].get("profiles") == ["submit"]
    assert "start_run" not in json.loads((out / "config" / "worker.json").read_text())


@pytest.mark.parametrize("text, refused", [
    ('run_id = "other"\ngroup_size = 4\n', "not the stack's"),
    ("group_size = 8\n", "not the trainer's"),
    ('group_size = 4\nrun_dir = "runs/x"\n', "run_dir must be left out"),
    ("group_size = 4\n[gate]\nevery_versions = 0\n", "every_versions"),
    ("group_size = [\n", "run.toml"),
])
def test_a_run_config_the_controller_would_refuse_is_refused_by_compose_config(text, refused):
    from rlfleet.common.errors import StartupError

    with pytest.raises(StartupError, match=re.escape(refused)):
        checked_run(stack_config(), text, "run.toml")


def test_port_base_gives_consecutive_ports_and_refuses_the_hosts_nats_and_redis():
    ports = compose_ports(20000)
    assert sorted(ports.values()) == list(range(20000, 20000 + len(ports)))
    with pytest.raises(Exception, match="4222"):
        compose_ports(4210)


# -- the stack, for real ------------------------------------------------------------------------


def docker_ready() -> str:
    """'' when a Docker engine answers, else why not."""
    if h.tool("docker") is None or h.tool("docker-compose") is None:
        return ("docker / docker-compose are not installed "
                "(scripts/install.sh installs docker.io and docker-compose)")
    result = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"],
                            capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        return ("no Docker engine answers (scripts/install.sh starts dockerd as root): "
                f"{result.stderr.strip()[-300:]}")
    return ""


def run(*cmd: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({result.returncode}):\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def metric(port: int, name: str) -> float:
    """The sum of a metric's samples on a metrics endpoint (0 when absent or unreachable)."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3).read().decode()
    except OSError:
        return 0.0
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


def engine_version(port: int, api_key: str) -> int:
    """The weight version the engine serves (SGLang 0.5.23's dialect: `/model_info`, behind its api
    key), -1 if unknown."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/model_info",
                                     headers={"Authorization": f"Bearer {api_key}"})
    try:
        reply = json.loads(urllib.request.urlopen(request, timeout=3).read())
        return int(reply["weight_version"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1


def controller_run(port: int, secrets: Path):
    """RunControl.GetRun on the stack's controller (None while it has no run or does not answer)."""
    import grpc

    from rlfleet.api.controller.v1 import controller_pb2, controller_pb2_grpc
    from rlfleet.common import security
    from rlfleet.common.grpc_server import blocking_channel

    with blocking_channel(f"127.0.0.1:{port}",
                          credentials=security.trusted_credentials(secrets, "operator")) as ch:
        try:
            return controller_pb2_grpc.RunControlStub(ch).GetRun(controller_pb2.GetRunRequest(), timeout=10)
        except grpc.RpcError:
            return None


def wait_for(what: str, predicate, timeout_s: float, logs) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(2)
    pytest.fail(f"{what}: not within {timeout_s:.0f} s\n{logs()}")


@pytest.mark.timeout(1800)
def test_the_stack_trains_and_compose_restarts_a_killed_container(tmp_path):
    why = docker_ready()
    if why:
        pytest.skip(why)
    started = time.monotonic()
    tag = f"rlfleet:compose-test-{uuid.uuid4().hex[:8]}"
    project = f"rlfleet-test-{uuid.uuid4().hex[:8]}"
    ports = compose_ports(None)
    write_stack(stack_config(), tmp_path, ports, tasks=400, project=project, run_config=RUN_TOML)
    env_file = tmp_path / "compose.env"
    env_file.write_text(env_file.read_text().replace("RLFLEET_IMAGE=rlfleet:dev", f"RLFLEET_IMAGE={tag}"))
    compose = ["docker-compose", "--env-file", str(env_file), "-f", str(h.COMPOSE_FILE), "-p", project]
    labels = f"label=com.docker.compose.project={project}"

    def logs() -> str:
        result = run(*compose, "logs", "--no-color", "--tail", "15", check=False, timeout=120)
        ps = run(*compose, "ps", check=False, timeout=60)
        return ps.stdout + result.stdout[-12000:]

    try:
        build = time.monotonic()
        run("bash", str(h.DEPLOY / "docker" / "build.sh"), tag, timeout=3600)
        build_s = time.monotonic() - build
        up = time.monotonic()
        run(*compose, "up", "-d", timeout=900)
        up_s = time.monotonic() - up
        up_done = time.monotonic()

        trainer = ports["trainer-metrics"]
        api_key = (tmp_path / "secrets" / "engine_api_key").read_text().strip()
        wait_for("the trainer publishes version 2 after training trajectories",
                 lambda: metric(trainer, "rlfleet_trainer_policy_version_number") >= 2
                 and metric(trainer, "rlfleet_trainer_trained_trajectories_total") > 0, 600, logs)
        wait_for("the engine serves a trained version",
                 lambda: engine_version(ports["engine-0"], api_key) >= 1, 300, logs)

        # A crash, as the kernel delivers it: SIGKILL to the container's main process (not `docker
        # stop`, after which compose would rightly leave it stopped).
        victim = run("docker", "ps", "-q", "--filter", labels, "--filter",
                     "label=com.docker.compose.service=worker").stdout.split()
        assert len(victim) == 1, victim
        pid = int(run("docker", "inspect", "-f", "{{.State.Pid}}", victim[0]).stdout)
        version_at_kill = metric(trainer, "rlfleet_trainer_policy_version_number")
        trained_at_kill = metric(trainer, "rlfleet_trainer_trained_trajectories_total")
        os.kill(pid, signal.SIGKILL)

        def restarted_and_healthy() -> bool:
            state = json.loads(run("docker", "inspect", victim[0]).stdout)[0]
            return state["RestartCount"] >= 1 and state["State"].get("Health", {}).get("Status") == "healthy"

        wait_for("compose restarts the killed worker and it is healthy again",
                 restarted_and_healthy, 180, logs)
        wait_for("the loop goes on: more trajectories trained, a newer version",
                 lambda: metric(trainer, "rlfleet_trainer_trained_trajectories_total") > trained_at_kill
                 and metric(trainer, "rlfleet_trainer_policy_version_number") > version_at_kill, 600, logs)

        # The controller's run, as its own RunControl.GetRun reports it (the operator's credentials
        # from the stack's secrets): driven by the controller, and its promotion gate has decided.
        run_info: list = []

        def gated() -> bool:
            info = controller_run(ports["controller"], tmp_path / "secrets")
            run_info[:] = [info]
            return info is not None and info.gate_decisions >= 1

        wait_for("the controller's run reaches a gate decision", gated, 900,
                 lambda: f"{run_info}\n{run(*compose, 'logs', '--no-color', '--tail', '40', 'controller', check=False).stdout[-8000:]}")  # noqa: E501
        gate_s = time.monotonic() - up_done
        info = run_info[0]
        assert info.driven_by == "controller" and info.status == "running", info
        print(f"\ncompose test: build {build_s:.0f} s, up {up_s:.0f} s, "
              f"first gate decision {gate_s:.0f} s after up "
              f"(accepted version {info.accepted_version}, {info.steps} steps), "
              f"total {time.monotonic() - started:.0f} s; "
              f"trainer at version {metric(trainer, 'rlfleet_trainer_policy_version_number'):.0f}")
    finally:
        run(*compose, "down", "--volumes", "--remove-orphans", "--timeout", "20", check=False, timeout=600)
        run("docker", "rmi", "-f", tag, check=False, timeout=300)
    left = {kind: run("docker", *cmd, check=False).stdout.split() for kind, cmd in {
        "containers": ("ps", "-aq", "--filter", labels),
        "volumes": ("volume", "ls", "-q", "--filter", labels),
        "networks": ("network", "ls", "-q", "--filter", labels),
        "images": ("images", "-q", tag)}.items()}
    assert not any(left.values()), f"left behind: {left}"
