"""The import contract (`[tool.importlinter]` in pyproject.toml): which rlfleet package may import which.

The tree keeps it; and a copy of the tree with one forbidden import added breaks it, so the contract
is not one that cannot fail. import-linter builds the import graph from the source (grimp), imports
inside functions included, without importing any of it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [*ROOT.glob("libs/*/src/rlfleet"), *ROOT.glob("services/*/src/rlfleet")]

# Runs import-linter on the rlfleet packages found in TREE only (the installed editable sources are
# taken off the path), with the contract of ROOT's pyproject.toml.
LINT = """
import sys
tree, config, *installed = sys.argv[1:]
sys.path[:] = [tree] + [p for p in sys.path if p and p not in installed]
from importlinter.cli import lint_imports
sys.exit(lint_imports(config_filename=config, no_cache=True, no_logo=True))
"""


def lint(tree: Path) -> subprocess.CompletedProcess:
    installed = [str(source.parent) for source in SOURCES]
    return subprocess.run([sys.executable, "-c", LINT, str(tree), str(ROOT / "pyproject.toml"), *installed],
                          capture_output=True, text=True, timeout=120, cwd="/")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of every package's sources, in one `rlfleet` namespace."""
    for source in SOURCES:
        for package in source.iterdir():
            if package.is_dir():
                shutil.copytree(package, tmp_path / "rlfleet" / package.name,
                                ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def add_import(tree: Path, module: str, statement: str) -> None:
    path = tree / (module.replace(".", "/") + ".py")
    # Inside a function, where imports that only hid a cycle used to be: the graph still has them.
    text = path.read_text() + f"\n\ndef _leak():\n    {statement}\n" if path.exists() else statement + "\n"
    path.write_text(text)


def test_the_tree_keeps_the_import_contract(tree):
    result = lint(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


LIBS_CONTRACT = "Libraries never import the CLI or a service"


@pytest.mark.parametrize(("module", "statement", "contract"), [
    ("rlfleet.gateway.leak", "from rlfleet.session import config", "Services never import each other"),
    ("rlfleet.envkit.testing", "from rlfleet.cli import platform_config", LIBS_CONTRACT),
    ("rlfleet.common.service", "import rlfleet.trainer.loop", LIBS_CONTRACT),
    ("rlfleet.verifier.app", "from rlfleet.cli import launcher", "Services never import the CLI"),
    ("rlfleet.cli.rl_loop", "from rlfleet.trainer import learner", "The CLI imports of the services only"),
    ("rlfleet.controller.app", "from rlfleet.cli import run_client",
     "The controller imports of the CLI only the loop"),
    ("rlfleet.broker.app", "from rlfleet.controller import run_control", "Services never import the CLI"),
    ("rlfleet.engine.build_model", "from rlfleet.envkit.corpus import default_corpus",
     "The engine does not import the environment kit"),
    ("rlfleet.weights.tensors", "from rlfleet.weights import torch_io", "No import cycles between"),
])
def test_a_forbidden_import_breaks_the_contract(tree, module, statement, contract):
    add_import(tree, module, statement)
    result = lint(tree)
    assert result.returncode != 0, result.stdout
    broken = [line for line in result.stdout.splitlines() if " BROKEN" in line]
    # Indirect chains count too: a library importing a service also makes every service that uses
    # the library depend on that one, so more than one contract may break.
    assert any(line.startswith(contract) for line in broken), result.stdout
