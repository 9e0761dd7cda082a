"""deploy/compose/compose.yaml: valid for docker compose, complete, scalable, and configured with
keys the services actually accept."""

from __future__ import annotations

import importlib
import re
import subprocess

import deploy_helpers as h
import pytest
import yaml

from rlfleet.common.config import ConfigError, env_overrides, resolve

# Compose services that run an rlfleet image with its default ENTRYPOINT (init jobs excluded).
INIT_JOBS = {"model-init", "suites-init"}
SCALABLE = {"session-server", "rollout-gateway", "sandbox-manager", "verifier", "worker"}


def image_of(service: dict) -> str | None:
    match = re.fullmatch(r"rlfleet/([\w-]+):.*", service.get("image", ""))
    return match.group(1) if match else None


def rlfleet_services(compose: dict) -> dict[str, dict]:
    return {name: s for name, s in compose["services"].items() if image_of(s) and name not in INIT_JOBS}


def compose_env(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    assert isinstance(env, dict), "use the mapping form of environment"
    return {k: re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(v)) for k, v in env.items()}


def test_docker_compose_accepts_the_file():
    docker_compose = h.tool("docker-compose")
    if docker_compose is None:
        pytest.skip("docker-compose is not installed (Debian: apt-get install docker-compose)")
    result = subprocess.run([docker_compose, "-f", str(h.COMPOSE_FILE), "config", "--quiet"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_the_env_file_names_the_project_and_defaults_every_variable(compose):
    env = dict(line.split("=", 1) for line in (h.COMPOSE_FILE.parent / ".env").read_text().splitlines()
               if line and not line.startswith("#"))
    assert env["COMPOSE_PROJECT_NAME"] == "rlfleet"
    used = set(re.findall(r"\$\{(\w+)(:-[^}]*)?\}", h.COMPOSE_FILE.read_text()))
    for name, default in used:
        assert default or name in env, f"${{{name}}} has neither a default nor a value in .env"


def test_every_image_has_a_compose_service_built_from_its_dockerfile(compose):
    built = {}
    for service in compose["services"].values():
        if "build" in service:
            assert service["build"]["context"] == "../.."
            built[image_of(service)] = h.ROOT / service["build"]["dockerfile"]
    assert built == h.IMAGES
    names = set(compose["services"])
    assert set(h.SERVICE_DIRS) | {"worker"} <= names, f"missing: {set(h.SERVICE_DIRS) - names}"


def test_infrastructure_nats_with_jetstream_and_8mb_payloads_and_redis(compose):
    nats = compose["services"]["nats"]
    assert "-js" in nats["command"]
    assert any(v.startswith("nats-data:") for v in nats["volumes"])
    conf = (h.COMPOSE_FILE.parent / "nats.conf").read_text()
    assert re.search(r"^max_payload:\s*8MB", conf, re.M)
    assert "store_dir: /data" in conf
    assert compose["services"]["redis"]["healthcheck"]["test"][-1] == "ping"
    assert "prometheus" in compose["services"] and compose["services"]["grafana"]["profiles"] == ["observability"]


def test_nats_server_accepts_the_config():
    nats = h.tool("nats-server") or (str(h.ROOT / ".venv/bin/nats-server")
                                     if (h.ROOT / ".venv/bin/nats-server").exists() else None)
    if nats is None:
        pytest.skip("nats-server is not installed")
    result = subprocess.run([nats, "-t", "-c", str(h.COMPOSE_FILE.parent / "nats.conf")],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def test_scalable_services_publish_no_host_port_and_have_no_fixed_name(compose):
    for name in SCALABLE | set(h.GRPC_SERVICES):
        service = compose["services"][name]
        assert "ports" not in service, f"{name} publishes a host port: --scale would collide"
        assert "container_name" not in service, name


def test_grpc_services_listen_on_fixed_ports_on_all_interfaces_and_check_grpc_health(compose):
    for name in h.GRPC_SERVICES:
        service = compose["services"][name]
        env = compose_env(service)
        assert env["RLFLEET__GRPC__HOST"] == "0.0.0.0" and env["RLFLEET__METRICS__HOST"] == "0.0.0.0"
        assert env["RLFLEET__GRPC__PORT"] == str(h.GRPC_PORT)
        assert env["RLFLEET__METRICS__PORT"] == str(h.METRICS_PORT)
        assert service["healthcheck"]["test"] == ["CMD", "rlfleet-healthcheck"], name


def test_dependencies_wait_for_health_or_completion(compose):
    services = compose["services"]
    for name, service in services.items():
        depends = service.get("depends_on", {})
        if name == "grafana":
            continue
        assert isinstance(depends, dict), f"{name}: depends_on needs conditions"
        for target, condition in depends.items():
            assert target in services, f"{name} depends on unknown {target}"
            wanted = condition["condition"]
            if target in INIT_JOBS:
                assert wanted == "service_completed_successfully", f"{name} -> {target}"
            else:
                assert wanted == "service_healthy", f"{name} -> {target}"
                assert "healthcheck" in services[target], f"{name} waits for {target}, which has no healthcheck"


def test_peers_are_reached_by_service_name_with_grpc_dns_resolution(compose):
    for name, service in rlfleet_services(compose).items():
        for key, value in compose_env(service).items():
            if key.endswith("_ADDRESS"):
                match = re.fullmatch(r"dns:///([\w-]+):(\d+)", value)
                assert match, f"{name}: {key}={value} is not dns:///SERVICE:PORT"
                assert match.group(1) in compose["services"] and int(match.group(2)) == h.GRPC_PORT


def test_shared_volumes_weight_store_models_and_suites(compose):
    def mounts(name):
        return {v.split(":")[0]: v.split(":")[1] for v in compose["services"][name].get("volumes", [])
                if ":" in v}

    for name in ("trainer", "weight-broker", "cpu-engine"):
        assert mounts(name).get("weights") == "/var/lib/rlfleet/weights", name
    assert not mounts("cpu-engine")["weights"].endswith(":rw")
    for name in ("trainer", "session-server", "cpu-engine", "model-init"):
        assert mounts(name).get("models") == "/models", name
    assert mounts("verifier").get("suites") == "/var/lib/rlfleet/suites"
    assert "rlfleet-build-model --out /models/policy" in " ".join(compose["services"]["model-init"]["command"])
    assert set(compose["volumes"]) >= {"nats-data", "weights", "models", "suites", "checkpoints"}


def test_the_sandbox_manager_gets_what_bubblewrap_needs_and_a_root_per_replica(compose):
    service = compose["services"]["sandbox-manager"]
    assert service["cap_add"] == ["SYS_ADMIN"]
    assert set(service["security_opt"]) == {"seccomp=unconfined", "apparmor=unconfined", "systempaths=unconfined"}
    assert "/var/lib/rlfleet/sandboxes" in service["volumes"], "anonymous volume: one per replica"
    # The host-wide uid leases: the same host directory in every manager (default driver.uid_lease_dir).
    assert "/run/rlfleet/sandbox-uids:/run/rlfleet/sandbox-uids" in service["volumes"]


def test_gateway_knows_the_cpu_engine(compose):
    engines = yaml.safe_load(compose_env(compose["services"]["rollout-gateway"])["RLFLEET__ENGINES"])
    assert engines == [{"engine_id": "cpu-engine-0", "url": f"http://cpu-engine:{h.ENGINE_PORT}",
                        "pool": "fleet", "kind": "cpu"}]
    assert "cpu-engine-0" in compose["services"]["cpu-engine"]["command"]


def config_model(service: str):
    module_name, attribute = h.CONFIG_MODELS[service]
    return getattr(importlib.import_module(module_name), attribute)


@pytest.mark.parametrize("service", [*h.GRPC_SERVICES, "worker"])
def test_service_environment_is_valid_config_for_that_service(compose, service):
    env = compose_env(compose["services"][service])
    model = config_model(service)
    try:
        config = resolve(model, {}, env_overrides(env), {})
    except ConfigError as exc:
        pytest.fail(f"{service}: its compose environment is not a valid config: {exc}")
    assert config.run_id == "compose"


def test_cpu_engine_command_is_valid_engine_config(compose):
    from rlfleet.engine.main import config_from_args

    command = [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", c) for c in compose["services"]["cpu-engine"]["command"]]
    config = config_from_args(command)
    assert (config.host, config.port, str(config.model_path)) == ("0.0.0.0", h.ENGINE_PORT, "/models/policy")
