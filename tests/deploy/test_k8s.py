"""deploy/k8s: a Kustomize base and two overlays, checked without a cluster."""

from __future__ import annotations

import base64
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import deploy_helpers as h
import pytest
import yaml

from rlfleet.cli.compose_config import IDENTITIES
from rlfleet.common.config import ConfigError, env_overrides, resolve

HPA_SERVICES = ("session-server", "rollout-gateway", "verifier", "sandbox-manager")
KUSTOMIZE_DIRS = [h.K8S / "base", *(h.K8S / "overlays" / o for o in h.OVERLAYS)]
# Workloads allowed without probes: the workers serve nothing; the registrar is a sidecar.
NO_PROBES = {"worker": "no server: restarted when its process exits"}
SIDECARS = {"register"}
K8S_VERSION = "1.30.0"


def workloads(objects):
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def manifest_files():
    for path in sorted(h.K8S.rglob("*.yaml")):
        if path.name != "kustomization.yaml" and "helm" not in path.parts:
            yield path


def test_every_manifest_parses_and_names_its_objects():
    count = 0
    for path in manifest_files():
        for doc in h.load_yaml_docs(path):
            assert doc.get("apiVersion") and doc.get("kind"), f"{path}: object without apiVersion/kind"
            assert doc.get("metadata", {}).get("name"), f"{path}: {doc['kind']} without metadata.name"
            count += 1
    assert count > 40


@pytest.mark.parametrize("directory", KUSTOMIZE_DIRS, ids=lambda d: d.name)
def test_kustomization_lists_existing_files_and_every_file_is_listed(directory):
    spec = h.kustomization(directory)
    listed = set()
    for entry in spec.get("resources", []) + h.patch_paths(spec):
        target = (directory / entry).resolve()
        assert target.exists(), f"{directory}/kustomization.yaml lists {entry}, which does not exist"
        if target.is_dir():
            assert (target / "kustomization.yaml").exists(), \
                f"{entry} is a directory without kustomization.yaml"
        listed.add(target)
    present = {p.resolve() for p in directory.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert present <= listed, \
        f"{directory}: files not in kustomization.yaml: {sorted(map(str, present - listed))}"


@pytest.mark.parametrize("overlay", h.OVERLAYS)
def test_the_test_renderer_agrees_with_kustomize(overlay):
    if h.kustomize_command() is None:
        pytest.skip("neither kustomize nor kubectl is installed: only the test renderer checks the overlays")
    ours = h.by_kind_name(h.render(h.K8S / "overlays" / overlay))
    theirs = h.by_kind_name(h.render_with_tool(h.K8S / "overlays" / overlay))
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert h.normalized(ours[key]) == h.normalized(theirs[key]), key


@pytest.mark.parametrize("overlay", h.OVERLAYS)
def test_overlays_validate_against_the_kubernetes_schemas(overlay, rendered, tmp_path):
    manifest = tmp_path / f"{overlay}.yaml"
    manifest.write_text(yaml.safe_dump_all(rendered[overlay]))
    if kubeconform := h.tool("kubeconform"):
        command = [kubeconform, "-strict", "-summary", "-kubernetes-version", K8S_VERSION, str(manifest)]
    elif validate := h.tool("kubernetes-validate"):
        command = [validate, "--strict", "--quiet", "-k", K8S_VERSION, str(manifest)]
    else:
        pytest.skip("no Kubernetes schema validator: install kubeconform, "
                    "or `pip install kubernetes-validate` in a tools venv on PATH")
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ERROR" not in result.stdout + result.stderr


def test_every_service_directory_and_the_worker_run_in_kubernetes(rendered):
    for overlay, objects in rendered.items():
        names = {o["metadata"]["name"] for o in workloads(objects)}
        expected = set(h.GRPC_SERVICES) | {"worker"} | ({"cpu-engine"} if overlay == "cpu-local" else set())
        assert expected <= names, f"{overlay} lacks {sorted(expected - names)}"
    assert "sglang-engine" in {o["metadata"]["name"] for o in workloads(rendered["gpu-cluster"])}


@pytest.mark.parametrize("overlay", h.OVERLAYS)
def test_workloads_have_probes_and_resources(overlay, rendered):
    for obj in workloads(rendered[overlay]):
        name = obj["metadata"]["name"]
        spec = h.pod_spec(obj)
        for container in spec.get("initContainers", []) + spec["containers"]:
            resources = container.get("resources", {})
            assert resources.get("requests", {}).get("cpu") and resources["requests"].get("memory"), \
                f"{overlay}: {name}/{container['name']} has no cpu/memory requests"
            assert resources.get("limits", {}).get("memory"), \
                f"{overlay}: {name}/{container['name']} no memory limit"
        for container in spec["containers"]:
            if name in NO_PROBES or container["name"] in SIDECARS:
                continue
            for probe in ("readinessProbe", "livenessProbe"):
                assert probe in container, f"{overlay}: {name}/{container['name']} has no {probe}"


@pytest.mark.parametrize("overlay", h.OVERLAYS)
def test_grpc_services_probe_their_health_over_tls_on_the_configured_port(overlay, rendered):
    objects = rendered[overlay]
    for obj in workloads(objects):
        name = obj["metadata"]["name"]
        if name not in h.GRPC_SERVICES:
            continue
        container = next(c for c in h.pod_spec(obj)["containers"] if c["name"] == name)
        env = h.resolve_env(container, objects)
        assert env["RLFLEET__GRPC__PORT"] == str(h.GRPC_PORT) and env["RLFLEET__GRPC__HOST"] == "0.0.0.0"
        assert env["RLFLEET__METRICS__PORT"] == str(h.METRICS_PORT)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            # kubelet's own gRPC probe speaks plaintext, which a TLS-only server refuses
            assert (container[probe]["exec"]["command"]
                    == ["rlfleet-healthcheck", f"127.0.0.1:{h.GRPC_PORT}"]), f"{name}.{probe}"
            assert container[probe].get("timeoutSeconds", 1) >= 3, \
                f"{name}.{probe}: Python and a TLS handshake"
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["grpc"] == h.GRPC_PORT and ports["metrics"] == h.METRICS_PORT
        annotations = obj["spec"]["template"]["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/scrape") == "true"
        assert annotations.get("prometheus.io/port") == str(h.METRICS_PORT)


@pytest.mark.parametrize("overlay", h.OVERLAYS)
def test_autoscalers_scale_the_stateless_services(overlay, rendered):
    objects = h.by_kind_name(rendered[overlay])
    for name in HPA_SERVICES:
        hpa = objects[("HorizontalPodAutoscaler", name)]
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("Deployment", name)
        deployment = objects[("Deployment", name)]
        assert "replicas" not in deployment["spec"], f"{name}: the HPA owns replicas"
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        container = h.pod_spec(deployment)["containers"][0]
        assert container["resources"]["requests"]["cpu"], "a CPU target needs a CPU request"


@pytest.mark.parametrize("overlay", h.OVERLAYS)
def test_services_select_pods_and_grpc_peers_are_headless(overlay, rendered):
    objects = rendered[overlay]
    pod_labels = [o["spec"]["template"]["metadata"]["labels"] for o in workloads(objects)]
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    for name, service in services.items():
        selector = service["spec"]["selector"]
        base_selector = {k: v for k, v in selector.items() if k != "apps.kubernetes.io/pod-index"}
        assert any(base_selector.items() <= labels.items() for labels in pod_labels), \
            f"Service {name} selects nothing"
    for name in h.GRPC_SERVICES:
        assert services[name]["spec"].get("clusterIP") == "None", \
            f"{name}: gRPC clients balance per call only over a headless Service"


@pytest.mark.parametrize("overlay", h.OVERLAYS)
def test_peer_addresses_name_existing_services(overlay, rendered):
    objects = rendered[overlay]
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    for container in h.all_containers(objects):
        for key, value in h.resolve_env(container, objects).items():
            for host, port in re.findall(r"(?:dns:///|nats://|tls://|redis://|rediss://|http://)"
                                         r"([a-z][\w-]*):(\d+)", value):
                assert host in services, f"{container['name']}: {key} names {host}, not a Service"
                ports = {p["port"] for p in services[host]["spec"]["ports"]}
                assert int(port) in ports, f"{container['name']}: {key}: {host} has no port {port}"


def config_model(service):
    module_name, attribute = h.CONFIG_MODELS[service]
    return getattr(importlib.import_module(module_name), attribute)


@pytest.mark.parametrize("overlay", h.OVERLAYS)
@pytest.mark.parametrize("service", [*h.GRPC_SERVICES, "worker"])
def test_service_environment_is_valid_config_for_that_service(overlay, service, rendered):
    objects = rendered[overlay]
    workload = (h.by_kind_name(objects).get(("Deployment", service))
                or h.by_kind_name(objects)[("StatefulSet", service)])
    container = next(c for c in h.pod_spec(workload)["containers"] if c["name"] == service)
    env = h.resolve_env(container, objects)
    try:
        resolve(config_model(service), {}, env_overrides(env), {})
    except ConfigError as exc:
        pytest.fail(f"{overlay}: {service}: its environment is not a valid config: {exc}")


def test_cpu_engine_args_are_valid_engine_config(rendered):
    from rlfleet.engine.main import config_from_args

    deployment = h.by_kind_name(rendered["cpu-local"])[("Deployment", "cpu-engine")]
    container = h.pod_spec(deployment)["containers"][0]
    config = config_from_args(container["args"])
    assert config.port == h.ENGINE_PORT and str(config.model_path) == "/models/policy"
    assert container["ports"][0]["containerPort"] == h.ENGINE_PORT
    gateway = h.by_kind_name(rendered["cpu-local"])[("Deployment", "rollout-gateway")]
    engines = yaml.safe_load(h.resolve_env(h.pod_spec(gateway)["containers"][0], rendered["cpu-local"])
                             ["RLFLEET__ENGINES"])
    assert engines[0]["engine_id"] == config.engine_id
    assert engines[0]["url"] == f"http://cpu-engine:{h.ENGINE_PORT}"


@pytest.mark.parametrize("overlay", h.OVERLAYS)
def test_trainer_runs_under_torchrun_with_a_rendezvous_service(overlay, rendered):
    objects = h.by_kind_name(rendered[overlay])
    trainer = objects[("StatefulSet", "trainer")]
    container = h.pod_spec(trainer)["containers"][0]
    env = h.resolve_env(container, rendered[overlay])
    assert container["command"] == ["torchrun"]
    args = container["args"]
    assert args[-2:] == ["--no-python", "rlfleet-trainer"]
    assert "rlfleet-trainer" in h.console_scripts()
    assert "--nnodes=$(TRAINER_NNODES)" in args and "--rdzv-backend=c10d" in args
    assert int(env["TRAINER_NNODES"]) == trainer["spec"]["replicas"]
    headless = objects[("Service", trainer["spec"]["serviceName"])]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
    endpoint = next(a for a in args if a.startswith("--rdzv-endpoint="))
    assert endpoint == f"--rdzv-endpoint=trainer-0.{trainer['spec']['serviceName']}:29400"
    assert trainer["spec"]["podManagementPolicy"] == "Parallel"
    if overlay == "gpu-cluster":
        assert env["RLFLEET__BACKEND__DEVICE"] == "cuda"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == env["TRAINER_NPROC_PER_NODE"]


@pytest.mark.parametrize("overlay", h.OVERLAYS)
def test_weight_store_is_one_volume_shared_by_trainer_broker_and_engines(overlay, rendered):
    objects = rendered[overlay]
    claim = h.by_kind_name(objects)[("PersistentVolumeClaim", "rlfleet-weights")]
    expected_mode = "ReadWriteOnce" if overlay == "cpu-local" else "ReadWriteMany"
    assert claim["spec"]["accessModes"] == [expected_mode]
    engine = "cpu-engine" if overlay == "cpu-local" else "sglang-engine"
    for name in ("trainer", "weight-broker", engine):
        obj = next(o for o in workloads(objects) if o["metadata"]["name"] == name)
        spec = h.pod_spec(obj)
        volume = next(v["name"] for v in spec["volumes"]
                      if v.get("persistentVolumeClaim", {}).get("claimName") == "rlfleet-weights")
        mounts = [m for c in spec["containers"] for m in c.get("volumeMounts", []) if m["name"] == volume]
        assert [m["mountPath"] for m in mounts] == ["/var/lib/rlfleet/weights"], name


def test_sglang_engines_run_on_gpus_and_register_with_the_gateway(rendered):
    objects = rendered["gpu-cluster"]
    deployment = h.by_kind_name(objects)[("Deployment", "sglang-engine")]
    spec = h.pod_spec(deployment)
    engine = next(c for c in spec["containers"] if c["name"] == "sglang")
    assert h.split_image(engine["image"])[0] == "lmsysorg/sglang"
    # The release the contract is taken from, and seeded sampling switched on (rollouts send sampling_seed).
    from rlfleet.common.engine_requests import SGLANG_IMAGE

    assert engine["image"] == SGLANG_IMAGE
    assert "--enable-deterministic-inference" in engine["args"]
    assert engine["command"] == ["python3", "-m", "sglang.launch_server"]
    assert f"--port={h.ENGINE_PORT}" in engine["args"] and "--model-path=/models/policy" in engine["args"]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    register = next(c for c in spec["containers"] if c["name"] == "register")
    assert register["command"] == ["rlfleet-register-engine"]
    assert h.split_image(register["image"])[0] == h.IMAGE_NAME  # the one image carries it
    env = h.resolve_env(register, objects)
    assert env["ENGINE_URL"] == f"http://$(POD_IP):{h.ENGINE_PORT}" and env["ENGINE_KIND"] == "sglang"
    assert env["GATEWAY_ADDRESS"] == f"dns:///rollout-gateway:{h.GRPC_PORT}"
    names = [e["name"] for e in register["env"]]
    assert names.index("POD_IP") < names.index("ENGINE_URL"), "$(POD_IP) expands only from earlier variables"
    assert "preStop" in engine["lifecycle"], "deregister before SGLang stops"


@pytest.mark.parametrize("overlay", h.OVERLAYS)
def test_only_the_sandbox_manager_runs_privileged_and_as_root(overlay, rendered):
    for obj in workloads(rendered[overlay]):
        name = obj["metadata"]["name"]
        if name in ("sglang-engine",):
            continue  # a third-party image that runs as root
        spec = h.pod_spec(obj)
        for container in spec["containers"]:
            context = container.get("securityContext", {})
            if name == "sandbox-manager":
                assert context == {"runAsUser": 0, "runAsNonRoot": False, "privileged": True}
                continue
            assert not context.get("privileged"), f"{name}/{container['name']}"
            assert context.get("allowPrivilegeEscalation") is False, f"{name}/{container['name']}"
            assert spec["securityContext"].get("runAsNonRoot") or context.get("runAsNonRoot"), name


# What a container of the one image may run: a console script of the repository, under tini or not,
# or one of these (a shell for the init waits, torchrun for the trainer, the image's helper scripts).
IMAGE_PROGRAMS = {"sh", "torchrun", "rlfleet-register-engine", "rlfleet-healthcheck"}


@pytest.mark.parametrize("overlay", h.OVERLAYS)
def test_every_rlfleet_container_runs_the_one_image_and_says_what_it_runs(overlay, rendered):
    scripts = h.console_scripts()
    seen = 0
    for container in h.all_containers(rendered[overlay]):
        name, _ = h.split_image(container["image"])
        assert not name.startswith("rlfleet/"), \
            f"{container['name']}: {container['image']}: one image, `rlfleet`"
        if name != h.IMAGE_NAME:
            continue
        seen += 1
        command = container.get("command")
        assert command, f"{overlay}: {container['name']} runs the rlfleet image without a command"
        program = next(w for w in command if w not in ("/usr/bin/tini", "--"))
        assert program in scripts or program in IMAGE_PROGRAMS, \
            f"{overlay}: {container['name']} runs {program}"
    assert seen >= 10


@pytest.mark.parametrize("overlay", h.OVERLAYS)
def test_every_image_has_a_pinned_tag(overlay, rendered):
    for container in h.all_containers(rendered[overlay]):
        _, tag = h.split_image(container["image"])
        assert tag, f"{overlay}: {container['name']}: {container['image']} has no tag"
        assert tag not in ("latest", "dev", "main", "nightly"), \
            f"{overlay}: {container['image']} is a moving tag"


@pytest.mark.parametrize("overlay", h.OVERLAYS)
def test_the_stateful_parts_have_disruption_budgets_that_select_their_pods(overlay, rendered):
    objects = rendered[overlay]
    budgets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "PodDisruptionBudget"}
    assert set(budgets) == {"nats", "redis", "trainer"}
    for name, budget in budgets.items():
        spec = budget["spec"]
        assert ("maxUnavailable" in spec) != ("minAvailable" in spec), name
        selected = [o for o in workloads(objects)
                    if all(o["spec"]["template"]["metadata"]["labels"].get(k) == v
                           for k, v in spec["selector"]["matchLabels"].items())]
        assert [o["kind"] for o in selected] == ["StatefulSet"], f"{overlay}: PDB {name} selects {selected}"
    # NATS tolerates one node down only where it has a quorum to lose one from.
    nats = h.by_kind_name(objects)[("StatefulSet", "nats")]
    assert budgets["nats"]["spec"]["maxUnavailable"] == 1 and nats["spec"]["replicas"] in (1, 3)


@pytest.mark.parametrize("overlay", h.OVERLAYS)
def test_every_container_has_resource_requests_and_limits(overlay, rendered):
    jobs = [o for o in rendered[overlay] if o["kind"] == "Job"]
    assert jobs, "the init jobs are checked too"
    for obj in [*workloads(rendered[overlay]), *jobs]:
        spec = h.pod_spec(obj)
        for container in spec.get("initContainers", []) + spec["containers"]:
            resources = container.get("resources", {})
            where = f"{overlay}: {obj['metadata']['name']}/{container['name']}"
            assert {"cpu", "memory"} <= set(resources.get("requests", {})), f"{where}: requests"
            assert "memory" in resources.get("limits", {}), f"{where}: memory limit"


def test_nats_is_jetstream_with_8mb_payloads_and_a_three_node_cluster_on_gpus(rendered):
    for overlay, objects in rendered.items():
        config = h.by_kind_name(objects)[("ConfigMap", "nats-config")]["data"]["nats.conf"]
        assert "max_payload: 8MB" in config and "jetstream" in config
        nats = h.by_kind_name(objects)[("StatefulSet", "nats")]
        assert "-js" in h.pod_spec(nats)["containers"][0]["command"]
        if overlay == "gpu-cluster":
            assert nats["spec"]["replicas"] == 3
            for index in range(3):
                assert f"nats://nats-{index}.nats-headless:6222" in config


@pytest.mark.parametrize("overlay", h.OVERLAYS)
def test_nats_server_accepts_the_rendered_config(overlay, rendered, generated_secrets, tmp_path):
    nats = h.tool("nats-server") or (str(h.ROOT / ".venv/bin/nats-server")
                                     if (h.ROOT / ".venv/bin/nats-server").exists() else None)
    if nats is None:
        pytest.skip("nats-server is not installed")
    objects = h.by_kind_name(rendered[overlay])
    text = objects[("ConfigMap", "nats-config")]["data"]["nats.conf"]
    assert "/etc/nats/tls/nats.pem" in text, "NATS serves TLS only"
    # The pod's /etc/nats here in tmp_path: each Secret item where the StatefulSet mounts it (`-t`
    # loads the certificates, so an item the config names and the pod does not mount fails here).
    spec = h.pod_spec(objects[("StatefulSet", "nats")])
    mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    for volume in spec["volumes"]:
        if "secret" in volume:
            data = generated_secrets[0][volume["secret"]["secretName"]]["data"]
            where = tmp_path / Path(mounts[volume["name"]]).relative_to("/etc/nats")
            materialize(where, data, {i["key"]: i["path"] for i in volume["secret"]["items"]})
    conf = tmp_path / "nats.conf"
    conf.write_text(text.replace("/etc/nats/", f"{tmp_path}/"))
    result = subprocess.run([nats, "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30,
                            env={"POD_NAME": "nats-0", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout + result.stderr
    if overlay == "gpu-cluster":
        # routes: mutual TLS with the route CA (tests/deploy/test_nats_cluster.py runs it)
        cluster = text[text.index("cluster {"):]
        assert "verify: true" in cluster and "/etc/nats/tls/nats-route-ca.pem" in cluster


def test_the_nats_helm_values_alternative_parses():
    values = yaml.safe_load((h.K8S / "helm" / "nats-values.yaml").read_text())
    assert values["config"]["jetstream"]["enabled"] and values["config"]["cluster"]["replicas"] == 3


@pytest.mark.parametrize("overlay", h.OVERLAYS)
def test_sandbox_managers_on_a_node_share_one_uid_lease_directory(overlay, rendered):
    manager = next(o for o in workloads(rendered[overlay]) if o["metadata"]["name"] == "sandbox-manager")
    spec = h.pod_spec(manager)
    volume = next(v for v in spec["volumes"] if v["name"] == "uid-leases")
    assert volume["hostPath"] == {"path": "/run/rlfleet/sandbox-uids", "type": "DirectoryOrCreate"}
    mounts = [m["mountPath"] for c in spec["containers"] for m in c.get("volumeMounts", [])
              if m["name"] == "uid-leases"]
    assert mounts == ["/run/rlfleet/sandbox-uids"]  # the driver's default uid_lease_dir


# -- trust boundaries -----------------------------------------------------------------------------

# Who calls whom, on which port: the service graph the NetworkPolicies must allow, and no more.
GRAPH = {
    ("session-server", "nats", 4222), ("trainer", "nats", 4222), ("weight-broker", "nats", 4222),
    ("worker", "nats", 4222), ("nats", "nats", 6222),
    ("rollout-gateway", "redis", 6379), ("session-server", "redis", 6379), ("sandbox-manager", "redis", 6379),
    ("verifier", "redis", 6379), ("weight-broker", "redis", 6379),
    ("session-server", "rollout-gateway", 50051), ("weight-broker", "rollout-gateway", 50051),
    ("engine", "rollout-gateway", 50051),  # an SGLang pod registers itself
    ("worker", "session-server", 50051), ("verifier", "session-server", 50051),
    ("worker", "sandbox-manager", 50051), ("verifier", "sandbox-manager", 50051),
    ("worker", "verifier", 50051), ("trainer", "trainer", 29400), ("trainer", "trainer", 29500),
    ("trainer", "weight-broker", 50051),  # trainer-sent weights ask the broker for a plan
    ("rollout-gateway", "engine", 30000), ("weight-broker", "engine", 30000),
    # The run's control: tasks and streams, admission, episodes (its rollout worker and evaluations),
    # audits, the trainer's status and data-wait counter, versions and promotion.
    ("controller", "nats", 4222), ("controller", "rollout-gateway", 50051),
    ("controller", "session-server", 50051), ("controller", "sandbox-manager", 50051),
    ("controller", "verifier", 50051), ("controller", "trainer", 50051), ("controller", "trainer", 9464),
    ("controller", "weight-broker", 50051),
}
PODS = ("nats", "redis", "rollout-gateway", "session-server", "sandbox-manager", "verifier", "trainer",
        "weight-broker", "worker", "engine", "controller")


def _labels(pod: str) -> dict[str, str]:
    if pod == "engine":
        return {"app.kubernetes.io/name": "cpu-engine", "app.kubernetes.io/component": "engine",
                "app.kubernetes.io/part-of": "rlfleet"}
    return {"app.kubernetes.io/name": pod, "app.kubernetes.io/part-of": "rlfleet"}


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def allowed(policies: list[dict], source: dict, target: dict, port: int) -> bool:
    """Whether an in-namespace pod with `source` labels may reach `target` on `port`."""
    for policy in policies:
        spec = policy["spec"]
        if not _selects(spec["podSelector"], target):
            continue
        for rule in spec.get("ingress", []):
            if not any(p["port"] == port for p in rule.get("ports", [])):
                continue
            for peer in rule.get("from", []):
                if "namespaceSelector" not in peer and _selects(peer["podSelector"], source):
                    return True
    return False


@pytest.mark.parametrize("overlay", h.OVERLAYS)
def test_network_policies_allow_the_service_graph_and_nothing_else(overlay, rendered):
    policies = [o for o in rendered[overlay] if o["kind"] == "NetworkPolicy"]
    deny = next(p for p in policies if p["metadata"]["name"] == "default-deny-ingress")
    assert deny["spec"]["podSelector"] == {} and "ingress" not in deny["spec"]
    ports = {port for _, _, port in GRAPH} | {9464}
    for source in PODS:
        for target in PODS:
            for port in ports:
                expected = (source, target, port) in GRAPH
                assert allowed(policies, _labels(source), _labels(target), port) == expected, \
                    (source, target, port)
    # Operators and environment clients come in by label, each only where its role needs.
    operator, env_client = {"rlfleet.io/operator": "true"}, {"rlfleet.io/env-client": "true"}
    assert allowed(policies, operator, _labels("trainer"), 50051)
    assert allowed(policies, env_client, _labels("session-server"), 50051)
    assert not allowed(policies, env_client, _labels("trainer"), 50051)
    assert not allowed(policies, env_client, _labels("nats"), 4222)
    assert not allowed(policies, env_client, _labels("redis"), 6379)
    sandbox = next(p for p in policies if p["metadata"]["name"] == "sandbox-manager")
    assert "Egress" in sandbox["spec"]["policyTypes"]  # untrusted code: DNS and Redis only
    assert {p["port"] for rule in sandbox["spec"]["egress"] for p in rule["ports"]} == {53, 6379}


@pytest.mark.parametrize("overlay", h.OVERLAYS)
def test_nats_and_redis_logins_come_from_the_secret_each_service_only_its_own(overlay, rendered):
    objects = rendered[overlay]
    redis = h.by_kind_name(objects)[("StatefulSet", "redis")]
    command = h.pod_spec(redis)["containers"][0]["command"]
    assert command[command.index("--protected-mode") + 1] == "yes" and "--aclfile" in command
    for obj in objects:
        spec = h.pod_spec(obj)
        if spec is None:
            continue
        for container in spec["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            for peer in ("NATS", "REDIS"):
                if f"RLFLEET__{peer}__URL" in env:
                    assert env[f"RLFLEET__{peer}__USER"], (obj["metadata"]["name"], peer)
                    assert env[f"RLFLEET__{peer}__PASSWORD_FILE"].startswith("/var/run/secrets/rlfleet/")
                    assert f"RLFLEET__{peer}__PASSWORD" not in env  # never inline
        secrets = [v["secret"] for v in spec.get("volumes", []) if "secret" in v
                   and v["secret"]["secretName"] == "rlfleet-infra-auth"]
        for secret in secrets:
            keys = [item["key"] for item in secret["items"]]
            name = obj["metadata"]["name"]
            assert all(name in key or key in ("nats-auth.conf", "redis.acl") for key in keys), (name, keys)


# -- gRPC trust material from Secrets ------------------------------------------------------------

TLS_SECRET = "rlfleet-tls"
SECRETS_ENV = "RLFLEET_SECRETS_DIR"  # rlfleet.common.security.SECRETS_ENV
ENGINE_KEYS = {"engine_api_key", "engine_admin_api_key"}
NEEDS_ENGINE_KEYS = {"rollout-gateway", "weight-broker"}  # they call the engines' HTTP API


def tls_mount(spec: dict, container: dict) -> tuple[str, dict[str, str]]:
    """Where `container` has the rlfleet-tls Secret and which keys it gets there (key -> path)."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        secret = volumes.get(mount["name"], {}).get("secret", {})
        if secret.get("secretName") == TLS_SECRET:
            assert mount.get("readOnly") is True, f"{container['name']}: {TLS_SECRET} mounted writable"
            assert "items" in secret, f"{container['name']}: all of {TLS_SECRET}, not just its own items"
            return mount["mountPath"], {i["key"]: i["path"] for i in secret["items"]}
    raise AssertionError(f"{container['name']} does not mount {TLS_SECRET}")


def all_pod_specs(objects):
    for obj in objects:
        spec = h.pod_spec(obj)
        if spec is not None:
            yield obj["metadata"]["name"], spec


@pytest.mark.parametrize("overlay", h.OVERLAYS)
@pytest.mark.parametrize("service", h.GRPC_SERVICES)
def test_every_container_of_a_grpc_service_has_its_own_tls_material(overlay, service, rendered):
    objects = rendered[overlay]
    workload = next(o for o in workloads(objects) if o["metadata"]["name"] == service)
    spec = h.pod_spec(workload)
    identity = IDENTITIES[service]
    for container in spec["containers"]:
        path, items = tls_mount(spec, container)
        env = h.resolve_env(container, objects)
        assert env.get(SECRETS_ENV) == path, f"{service}/{container['name']}: {SECRETS_ENV} is not the mount"
        expected = {"ca.pem": "ca.pem", "token.key": "token.key", f"{identity}.pem": f"certs/{identity}.pem"}
        if service in NEEDS_ENGINE_KEYS:
            expected |= {key: key for key in ENGINE_KEYS}
        # Just one certificate: the health check and the service take the only one in certs/ as theirs.
        assert items == expected, f"{overlay}: {service}/{container['name']}"
    if spec.get("securityContext", {}).get("runAsUser", 0) != 0:
        assert spec["securityContext"].get("fsGroup") == spec["securityContext"]["runAsUser"], \
            f"{service}: 0440 Secret files are readable only through the pod's fsGroup"


@pytest.mark.parametrize("overlay", h.OVERLAYS)
def test_workers_and_engines_get_their_credentials_from_the_secret(overlay, rendered):
    objects = rendered[overlay]
    pods = dict(all_pod_specs(objects))
    worker = next(c for c in pods["worker"]["containers"] if c["name"] == "worker")
    path, items = tls_mount(pods["worker"], worker)
    env = h.resolve_env(worker, objects)
    # An environment client: the CA certificate and its token, no service certificate or token key.
    assert items == {"ca.pem": "ca.pem", "worker.token": "worker.token"}
    assert (env["RLFLEET__CA_FILE"] == f"{path}/ca.pem"
            and env["RLFLEET__TOKEN_FILE"] == f"{path}/worker.token")
    assert SECRETS_ENV not in env
    if overlay == "cpu-local":
        engine = pods["cpu-engine"]["containers"][0]
        path, items = tls_mount(pods["cpu-engine"], engine)
        assert set(items) == ENGINE_KEYS and h.resolve_env(engine, objects)[SECRETS_ENV] == path
    else:
        spec = pods["sglang-engine"]
        sglang = next(c for c in spec["containers"] if c["name"] == "sglang")
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in sglang["env"]
                if "secretKeyRef" in e.get("valueFrom", {})}
        assert (f"--api-key=$({next(n for n, r in refs.items() if r['key'] == 'engine_api_key')})"
                in sglang["args"])
        assert ("--admin-api-key=$("
                f"{next(n for n, r in refs.items() if r['key'] == 'engine_admin_api_key')})"
                in sglang["args"])
        register = next(c for c in spec["containers"] if c["name"] == "register")
        path, items = tls_mount(spec, register)
        assert h.resolve_env(register, objects)[SECRETS_ENV] == path
        assert items == {"ca.pem": "ca.pem", "token.key": "token.key",
                         "engine-registrar.pem": "certs/engine-registrar.pem"}


@pytest.mark.parametrize("overlay", h.OVERLAYS)
def test_no_native_grpc_probe_remains(overlay, rendered):
    for name, spec in all_pod_specs(rendered[overlay]):
        for container in spec.get("initContainers", []) + spec["containers"]:
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert "grpc" not in container.get(probe, {}), \
                    f"{overlay}: {name}/{container['name']}.{probe}"


@pytest.fixture(scope="module")
def generated_secrets(tmp_path_factory):
    """deploy/k8s/make_secrets.py's output, as docs/deploy.md says to run it, and the directory it kept."""
    directory = tmp_path_factory.mktemp("k8s-credentials")
    return {s["metadata"]["name"]: s for s in h.make_secrets(directory)}, directory


def test_generated_secrets_carry_no_ca_key(generated_secrets):
    secrets, directory = generated_secrets
    assert set(secrets) == {"rlfleet-infra-auth", TLS_SECRET}
    ca_key = (directory / "ca.key").read_bytes()
    assert b"PRIVATE KEY" in ca_key
    for name, secret in secrets.items():
        assert secret["kind"] == "Secret" and secret["metadata"]["namespace"] == "rlfleet"
        assert "ca.key" not in secret["data"], name
        for key, value in secret["data"].items():
            assert ca_key.strip() not in base64.b64decode(value), f"{name}/{key} holds the CA key"


def test_only_the_controller_may_touch_the_run_state(generated_secrets, rendered):
    """The run's state (JetStream KV RLFLEET_RUNS): the controller's user gets its run's keys, no one
    else any."""
    auth = base64.b64decode(generated_secrets[0]["rlfleet-infra-auth"]["data"]["nats-auth.conf"]).decode()
    listed = json.loads(auth.split("authorization", 1)[1])["users"]
    users = {u["user"]: u.get("permissions", {}) for u in listed}
    assert {name for name, p in users.items() if "RLFLEET_RUNS" in json.dumps(p)} == {"controller"}
    objects = rendered["cpu-local"]
    controller = h.pod_spec(h.by_kind_name(objects)[("Deployment", "controller")])["containers"][0]
    env = h.resolve_env(controller, objects)
    assert f"$KV.RLFLEET_RUNS.{env['RLFLEET__RUN_ID']}.>" in users["controller"]["publish"]["allow"]


def test_generated_certificates_are_signed_by_the_run_ca(generated_secrets, tmp_path):
    data = {k: base64.b64decode(v) for k, v in generated_secrets[0][TLS_SECRET]["data"].items()}
    (tmp_path / "ca.pem").write_bytes(data["ca.pem"])
    for identity in [*IDENTITIES.values(), "engine-registrar"]:
        (tmp_path / "leaf.pem").write_bytes(data[f"{identity}.pem"])
        result = subprocess.run(["openssl", "verify", "-CAfile", str(tmp_path / "ca.pem"),
                                 str(tmp_path / "leaf.pem")],
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, identity + result.stdout + result.stderr


@pytest.mark.parametrize("overlay", h.OVERLAYS)
def test_every_secret_key_a_pod_uses_is_generated_and_none_is_a_ca_key(overlay, rendered, generated_secrets):
    secrets, _ = generated_secrets
    objects = rendered[overlay]
    for obj in objects:
        if obj["kind"] == "Secret":  # none is shipped, but one added to an overlay must not carry the CA key
            assert "ca.key" not in {**obj.get("data", {}), **obj.get("stringData", {})}, \
                obj["metadata"]["name"]
    used = 0
    for name, spec in all_pod_specs(objects):
        refs = [(v["secret"]["secretName"], i["key"]) for v in spec.get("volumes", []) if "secret" in v
                for i in v["secret"].get("items", [])]
        refs += [(e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
                 for c in spec.get("initContainers", []) + spec["containers"] for e in c.get("env", [])
                 if "secretKeyRef" in e.get("valueFrom", {})]
        for secret, key in refs:
            assert key != "ca.key", f"{overlay}: {name} mounts the CA key"
            if secret.startswith("rlfleet-"):  # not the operator's own (gpu-cluster's optional hf-token)
                assert secret in secrets and key in secrets[secret]["data"], \
                    f"{overlay}: {name}: {secret}/{key} is not made"
                used += 1
    assert used > 20


SERVE_HEALTH = """
import asyncio, sys
from rlfleet.common import security
from rlfleet.common.config import GrpcServerConfig
from rlfleet.common.grpc_server import GrpcServer

async def main():
    security.set_identity(sys.argv[1])
    server = GrpcServer(GrpcServerConfig())
    print(await server.start(), flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def materialize(directory, data: dict[str, str], items: dict[str, str]) -> None:
    """A Secret volume as the kubelet writes it: each item's key at its path."""
    for key, path in items.items():
        (directory / path).parent.mkdir(parents=True, exist_ok=True)
        (directory / path).write_bytes(base64.b64decode(data[key]))


def probe_exits(command: list[str], port: int, secrets_dir, **extra: str) -> subprocess.CompletedProcess:
    program, address = command
    assert program == "rlfleet-healthcheck" and address == f"127.0.0.1:{h.GRPC_PORT}"
    env = ({k: v for k, v in os.environ.items() if not k.startswith("RLFLEET")}
           | {SECRETS_ENV: str(secrets_dir), **extra})
    return subprocess.run([sys.executable, str(h.DEPLOY / "docker" / "healthcheck.py"), f"127.0.0.1:{port}"],
                          capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("service", ["session-server", "rollout-gateway"])
def test_the_probe_passes_with_just_the_mounted_items_and_fails_without_the_certificate(
        service, rendered, generated_secrets, tmp_path):
    objects = rendered["cpu-local"]
    spec = h.pod_spec(next(o for o in workloads(objects) if o["metadata"]["name"] == service))
    container = next(c for c in spec["containers"] if c["name"] == service)
    _, items = tls_mount(spec, container)
    data = generated_secrets[0][TLS_SECRET]["data"]
    pod, without_cert = tmp_path / "pod", tmp_path / "no-cert"
    materialize(pod, data, items)
    materialize(without_cert, data, {k: p for k, p in items.items() if not p.startswith("certs/")})
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLFLEET")} | {SECRETS_ENV: str(pod)}
    server = subprocess.Popen([sys.executable, "-c", SERVE_HEALTH, f"rlfleet-{IDENTITIES[service]}"],
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        port = int(server.stdout.readline())
        command = container["readinessProbe"]["exec"]["command"]
        passed = probe_exits(command, port, pod)
        assert passed.returncode == 0, passed.stderr
        # Mutual TLS: without the container's own certificate the handshake fails, even for a caller
        # with the CA certificate and a valid token (the workers').
        token = base64.b64decode(data["worker.token"]).decode().strip()
        refused = probe_exits(command, port, without_cert, RLFLEET_TOKEN=token)
        assert refused.returncode == 1 and "UNAVAILABLE" in refused.stderr, refused.stderr
    finally:
        server.kill()
        server.wait(timeout=10)
