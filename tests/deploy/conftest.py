"""Fixtures of the deploy tests (docker compose, Kubernetes, Dockerfiles, Prometheus).

The tests need no Docker engine and no cluster. Validators that may be absent (docker-compose,
kubectl/kustomize, kubeconform or kubernetes-validate, hadolint, promtool, nats-server) make
the tests that need them skip, saying what to install.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))

import deploy_helpers as h


@pytest.fixture(scope="session")
def compose() -> dict:
    return yaml.safe_load(h.COMPOSE_FILE.read_text())


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict]]:
    """Each overlay, rendered by kubectl/kustomize when installed, else by the test renderer."""
    use_tool = h.kustomize_command() is not None
    return {name: (h.render_with_tool if use_tool else h.render)(h.K8S / "overlays" / name)
            for name in h.OVERLAYS}
