"""Prometheus scrapes every service that serves metrics, under compose and on Kubernetes."""

from __future__ import annotations

import subprocess

import deploy_helpers as h
import pytest
import yaml

PROMETHEUS = h.DEPLOY / "prometheus"


def scrape_configs(name: str) -> list[dict]:
    return yaml.safe_load((PROMETHEUS / name).read_text())["scrape_configs"]


def generated_prometheus(tmp_path) -> tuple[dict, dict[str, int]]:
    from rlfleet.cli.compose_config import choose_ports, write_stack
    from rlfleet.cli.platform_config import PlatformConfig
    from rlfleet.common.config import read_toml

    ports = choose_ports(None)
    write_stack(PlatformConfig(**read_toml(str(h.COMPOSE_FILE.parent / "rlfleet.toml"))), tmp_path, ports, 10)
    return yaml.safe_load((tmp_path / "prometheus.yml").read_text()), ports


def test_compose_prometheus_scrapes_every_process_with_metrics_on_its_loopback_port(compose, tmp_path):
    config, ports = generated_prometheus(tmp_path)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    expected = (set(h.SERVICE_DIRS) - set(h.NO_METRICS)) | {"worker"}
    assert set(jobs) == expected, f"scraped: {sorted(jobs)}"
    for name in expected:
        assert jobs[name]["static_configs"] == [{"targets": [f"127.0.0.1:{ports[name + '-metrics']}"]}]
    mount = compose["services"]["prometheus"]["volumes"][0]
    assert mount.startswith("${RLFLEET_PROMETHEUS_CONFIG:-../../runs/compose/prometheus.yml}:")


def test_promtool_accepts_the_generated_compose_config(tmp_path):
    promtool = h.tool("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install --no-install-recommends prometheus)")
    generated_prometheus(tmp_path)
    result = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
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
                     and (o["spec"]["template"]["metadata"].get("annotations", {})
                          .get("prometheus.io/scrape") == "true")}
        expected = (set(h.SERVICE_DIRS) - set(h.NO_METRICS)) | {"worker"}
        assert expected <= annotated, f"{overlay}: not scraped: {sorted(expected - annotated)}"
