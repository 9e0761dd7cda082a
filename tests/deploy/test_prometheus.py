"""Prometheus scrapes every service that serves metrics, under compose and on Kubernetes."""

from __future__ import annotations

import subprocess

import deploy_helpers as h
import pytest
import yaml

PROMETHEUS = h.DEPLOY / "prometheus"


def scrape_configs(name: str) -> list[dict]:
    return yaml.safe_load((PROMETHEUS / name).read_text())["scrape_configs"]


def test_compose_prometheus_scrapes_every_service_with_metrics_on_every_replica(compose):
    jobs = {job["job_name"]: job for job in scrape_configs("prometheus.yml")}
    expected = (set(h.SERVICE_DIRS) - set(h.NO_METRICS)) | {"worker"}
    assert expected <= set(jobs), f"not scraped: {sorted(expected - set(jobs))}"
    for name in expected:
        # DNS service discovery: one target per replica, so `--scale` is scraped whole.
        (sd,) = jobs[name]["dns_sd_configs"]
        assert sd == {"names": [name], "type": "A", "port": h.METRICS_PORT, "refresh_interval": "15s"}
        env = compose["services"][name]["environment"]
        assert env["RLFLEET__METRICS__PORT"] == str(h.METRICS_PORT) and env["RLFLEET__METRICS__HOST"] == "0.0.0.0"
    mount = compose["services"]["prometheus"]["volumes"][0]
    assert mount.startswith("../prometheus/prometheus.yml:")


@pytest.mark.parametrize("name", ["prometheus.yml"])
def test_promtool_accepts_the_config(name):
    promtool = h.tool("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install --no-install-recommends prometheus)")
    result = subprocess.run([promtool, "check", "config", str(PROMETHEUS / name)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def test_kubernetes_prometheus_keeps_annotated_pods_of_the_namespace(rendered):
    # Debian's promtool is built without Kubernetes discovery, so this file is checked by shape.
    (job,) = scrape_configs("prometheus-k8s.yml")
    (sd,) = job["kubernetes_sd_configs"]
    namespace = next(o for o in rendered["cpu-local"] if o["kind"] == "Namespace")["metadata"]["name"]
    assert sd == {"role": "pod", "namespaces": {"names": [namespace]}}
    keep = job["relabel_configs"][0]
    assert keep["source_labels"] == ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"]
    assert keep["action"] == "keep" and keep["regex"] == "true"
    for overlay, objects in rendered.items():
        annotated = {o["metadata"]["name"] for o in objects if o["kind"] in ("Deployment", "StatefulSet")
                     and o["spec"]["template"]["metadata"].get("annotations", {}).get("prometheus.io/scrape") == "true"}
        expected = (set(h.SERVICE_DIRS) - set(h.NO_METRICS)) | {"worker"}
        assert expected <= annotated, f"{overlay}: not scraped: {sorted(expected - annotated)}"
