"""Shared knowledge of the deploy tests: where things are, which images exist, how to read a
Dockerfile, and a small kustomize renderer for machines without kubectl/kustomize.

The renderer knows what deploy/k8s uses and no more: `resources` (files and directories),
`patches` with `path` (strategic-merge patches matched on kind and name; lists of named items
merged by name, other lists replaced), `namespace` and `images`. When kubectl or kustomize is
installed, a test checks that this renderer and the real one agree on every overlay.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "compose" / "compose.yaml"
K8S = DEPLOY / "k8s"
OVERLAYS = ("cpu-local", "gpu-cluster")

GRPC_PORT = 50051
METRICS_PORT = 9464
ENGINE_PORT = 30000

# Every deployable: service directories plus the rollout workers, which live in libs/envkit.
SERVICE_DIRS = sorted(p.name for p in (ROOT / "services").iterdir() if (p / "pyproject.toml").exists())
# One image for every process (deploy/docker/Dockerfile); what a container runs is its command.
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
IMAGE_NAME = "rlfleet"
# The CPU engine serves SGLang's HTTP API only: no gRPC, no Prometheus endpoint.
NO_METRICS = {"cpu-engine": "serves SGLang's HTTP API only, no /metrics endpoint"}
GRPC_SERVICES = sorted(set(SERVICE_DIRS) - {"cpu-engine"})

# The typed config model of each service (rlfleet.common.config.ServiceConfig subclasses).
CONFIG_MODELS = {
    "session-server": ("rlfleet.session.config", "SessionServerConfig"),
    "rollout-gateway": ("rlfleet.gateway.config", "RolloutGatewayConfig"),
    "sandbox-manager": ("rlfleet.sandbox.config", "SandboxManagerConfig"),
    "verifier": ("rlfleet.verifier.config", "VerifierConfig"),
    "weight-broker": ("rlfleet.broker.config", "WeightBrokerConfig"),
    "trainer": ("rlfleet.trainer.service_config", "TrainerConfig"),
    "controller": ("rlfleet.controller.config", "ControllerConfig"),
    "worker": ("rlfleet.envkit.worker_config", "WorkerConfig"),
}


def console_scripts() -> dict[str, Path]:
    """Every `[project.scripts]` name of the repository, with the pyproject declaring it."""
    scripts: dict[str, Path] = {}
    for pyproject in sorted([*ROOT.glob("services/*/pyproject.toml"), *ROOT.glob("libs/*/pyproject.toml")]):
        project = tomllib.loads(pyproject.read_text())["project"]
        for name in project.get("scripts", {}):
            scripts[name] = pyproject
    return scripts


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def tool(*names: str) -> str | None:
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    return None


# ---------------------------------------------------------------------------------------------
# Dockerfiles


@dataclass
class Instruction:
    keyword: str
    args: str
    line: int


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None


def parse_dockerfile(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages): instructions with continuation lines joined, comments dropped."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    logical: list[tuple[int, str]] = []
    buffer, start = "", 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not buffer and (not line or line.startswith("#")):
            continue
        if buffer and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if not buffer:
            start = number
        if line.endswith("\\"):
            buffer += line[:-1] + " "
            continue
        logical.append((start, buffer + line))
        buffer = ""
    for number, text in logical:
        keyword, _, args = text.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            parts = args.split()
            name = parts[2] if len(parts) >= 3 and parts[1].lower() == "as" else None
            stages.append(Stage(parts[0], name))
        elif not stages:
            if keyword == "ARG":
                key, _, value = args.partition("=")
                global_args[key.strip()] = value.strip()
        else:
            stages[-1].instructions.append(Instruction(keyword, args.strip(), number))
    return global_args, stages


def exec_form(instruction: Instruction) -> list[str]:
    """The JSON array of an exec-form ENTRYPOINT/CMD/HEALTHCHECK CMD."""
    text = instruction.args
    if instruction.keyword == "HEALTHCHECK":
        text = text[text.index("CMD") + 3:].strip()
    value = json.loads(text)
    assert isinstance(value, list), f"line {instruction.line}: not exec form: {instruction.args}"
    return value


# ---------------------------------------------------------------------------------------------
# .dockerignore


def dockerignore_patterns() -> list[tuple[bool, str]]:
    patterns = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            negate = line.startswith("!")
            patterns.append((negate, line.lstrip("!").strip("/")))
    return patterns


def _matches(pattern: str, path: str) -> bool:
    # Docker's rules: filepath.Match per component, `**` any number of directories, and a
    # pattern that matches a directory excludes everything below it.
    regex = ""
    for part in re.split(r"(\*\*/?)", pattern):
        if part.startswith("**"):
            regex += "(?:.*/)?" if part.endswith("/") else ".*"
        else:
            regex += fnmatch.translate(part).removeprefix("(?s:").removesuffix(")\\Z").replace(".*", "[^/]*")
    return re.fullmatch(regex + "(?:/.*)?", path) is not None


def dockerignored(path: str) -> bool:
    ignored = False
    for negate, pattern in dockerignore_patterns():
        if _matches(pattern, path):
            ignored = not negate
    return ignored


# ---------------------------------------------------------------------------------------------
# Kustomize


def make_secrets(directory: Path) -> list[dict[str, Any]]:
    """deploy/k8s/make_secrets.py run as docs/deploy.md says (credentials kept in `directory`): the
    Secrets it prints."""
    result = subprocess.run([sys.executable, str(K8S / "make_secrets.py"), str(directory)],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return list(yaml.safe_load_all(result.stdout))


def kustomization(directory: Path) -> dict[str, Any]:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def patch_paths(spec: dict[str, Any]) -> list[str]:
    paths = []
    for patch in spec.get("patches", []) + spec.get("patchesStrategicMerge", []):
        paths.append(patch if isinstance(patch, str) else patch["path"])
    return paths


CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass",
                  "CustomResourceDefinition", "PriorityClass"}


def render(directory: Path) -> list[dict[str, Any]]:
    """kustomize build, for the subset of kustomize that deploy/k8s uses."""
    spec = kustomization(directory)
    unsupported = set(spec) - {"apiVersion", "kind", "namespace", "resources", "patches", "images"}
    assert not unsupported, f"{directory}: the test renderer does not know {sorted(unsupported)}"
    objects: list[dict[str, Any]] = []
    for resource in spec.get("resources", []):
        target = (directory / resource).resolve()
        objects += render(target) if target.is_dir() else load_yaml_docs(target)
    for path in patch_paths(spec):
        for patch in load_yaml_docs(directory / path):
            matches = [o for o in objects if o["kind"] == patch["kind"]
                       and o["metadata"]["name"] == patch["metadata"]["name"]]
            assert len(matches) == 1, (
                f"{directory / path}: patch {patch['kind']}/{patch['metadata']['name']} "
                f"matches {len(matches)} objects")
            index = objects.index(matches[0])
            objects[index] = strategic_merge(matches[0], patch)
    if "namespace" in spec:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = spec["namespace"]
    for image in spec.get("images", []):
        for container in all_containers(objects):
            name, tag = split_image(container["image"])
            if name == image["name"]:
                new_name = image.get("newName", name)
                new_tag = image.get("newTag", tag)
                container["image"] = f"{new_name}:{new_tag}" if new_tag else new_name
    return objects


def split_image(image: str) -> tuple[str, str | None]:
    name = image.partition("@")[0]
    if ":" in name.rsplit("/", 1)[-1]:
        name, tag = name.rsplit(":", 1)
        return name, tag
    return name, None


def strategic_merge(base: Any, patch: Any) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(base)
        for key, value in patch.items():
            merged[key] = strategic_merge(base[key], value) if key in base else copy.deepcopy(value)
        return merged
    if isinstance(base, list) and isinstance(patch, list) and base and patch \
            and all(isinstance(i, dict) and "name" in i for i in base + patch):
        merged = [copy.deepcopy(i) for i in base]
        for item in patch:
            for position, existing in enumerate(merged):
                if existing["name"] == item["name"]:
                    merged[position] = strategic_merge(existing, item)
                    break
            else:
                merged.append(copy.deepcopy(item))
        return merged
    return copy.deepcopy(patch)


def pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"):
        return obj["spec"]["template"]["spec"]
    if obj["kind"] == "CronJob":
        return obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    if obj["kind"] == "Pod":
        return obj["spec"]
    return None


def all_containers(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    containers = []
    for obj in objects:
        spec = pod_spec(obj)
        if spec is not None:
            containers += spec.get("initContainers", []) + spec.get("containers", [])
    return containers


def kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def render_with_tool(directory: Path) -> list[dict[str, Any]]:
    command = kustomize_command()
    assert command is not None
    result = subprocess.run([*command, str(directory)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d is not None]


def normalized(value: Any) -> Any:
    """Order-insensitive form: lists of named items sorted by name (kustomize reorders them)."""
    if isinstance(value, dict):
        return {k: normalized(v) for k, v in value.items()}
    if isinstance(value, list):
        items = [normalized(v) for v in value]
        if items and all(isinstance(i, dict) and "name" in i for i in items):
            items.sort(key=lambda i: str(i["name"]))
        return items
    return value


def by_kind_name(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def resolve_env(container: dict[str, Any], objects: list[dict[str, Any]]) -> dict[str, str]:
    """A container's environment as the kubelet builds it (envFrom ConfigMaps, then env);
    fieldRef/secret values become a placeholder."""
    config_maps = {o["metadata"]["name"]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(config_maps[source["configMapRef"]["name"]])
    for item in container.get("env", []):
        env[item["name"]] = str(item["value"]) if "value" in item else "placeholder"
    return env


# -- the metrics catalogue (docs/metrics.md) --------------------------------------------------------

METRICS_DOC = ROOT / "docs" / "metrics.md"
METRIC_TYPES = ("counter", "gauge", "histogram")


@dataclass(frozen=True)
class CatalogueEntry:
    name: str        # as Prometheus sees it (counters with _total)
    type: str        # counter | gauge | histogram
    labels: tuple[str, ...]
    service: str
    meaning: str


def metrics_catalogue() -> dict[str, CatalogueEntry]:
    """The rows of docs/metrics.md's tables: | `name` | type | labels | service | meaning |."""
    entries: dict[str, CatalogueEntry] = {}
    for line in METRICS_DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not cells[0].startswith("`rlfleet_"):
            continue
        name, kind, labels, service, meaning = cells
        name = name.strip("`")
        assert kind in METRIC_TYPES, f"{name}: type {kind!r} is not one of {METRIC_TYPES}"
        assert name not in entries, f"{name} is catalogued twice"
        label_names = tuple(sorted(x.strip("` ") for x in labels.split(",") if x.strip("` -—")))
        entries[name] = CatalogueEntry(name, kind, label_names, service, meaning)
    return entries
