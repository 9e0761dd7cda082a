"""The Grafana dashboard: a valid provisioned dashboard over catalogued metrics only."""

from __future__ import annotations

import json
import re
import subprocess

import deploy_helpers as h
import pytest
import yaml

GRAFANA = h.DEPLOY / "grafana" / "provisioning"
DASHBOARD = GRAFANA / "dashboards" / "rlfleet.json"
METRIC_RE = re.compile(r"\brlfleet_[a-z0-9_]+")
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def expressions(dashboard: dict) -> list[str]:
    return [t["expr"] for p in panels(dashboard) for t in p["targets"]]


def test_the_dashboard_is_a_dashboard_with_panels_that_query_the_provisioned_data_source(dashboard):
    [source] = yaml.safe_load((GRAFANA / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["uid"]
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert len(panels(dashboard)) >= 10
    for panel in panels(dashboard):
        assert panel["type"] in ("timeseries", "stat", "gauge", "bargauge", "heatmap", "table"), \
            panel["title"]
        assert (set(panel["gridPos"]) == {"h", "w", "x", "y"}
                and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24)
        assert panel["datasource"] == {"type": "prometheus", "uid": source["uid"]}, panel["title"]
        assert panel["targets"], f"{panel['title']} queries nothing"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == source["uid"] and target["expr"].strip()
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]


def test_the_provider_loads_the_dashboard_from_where_compose_mounts_it(compose):
    [provider] = yaml.safe_load((GRAFANA / "dashboards" / "rlfleet.yml").read_text())["providers"]
    mounts = [v.split(":") for v in compose["services"]["grafana"]["volumes"]]
    mounted = {target: source for source, target, *_ in mounts}
    assert mounted["/etc/grafana/provisioning"] == "../grafana/provisioning"
    relative = provider["options"]["path"].removeprefix("/etc/grafana/provisioning/")
    assert (GRAFANA / relative / DASHBOARD.name).exists()


def test_every_metric_the_dashboard_queries_is_in_the_catalogue_with_a_type_that_fits(dashboard):
    catalogue = h.metrics_catalogue()
    used = set()
    for expr in expressions(dashboard):
        for series in METRIC_RE.findall(expr):
            base = next((series.removesuffix(s) for s in HISTOGRAM_SERIES
                         if series.endswith(s) and series.removesuffix(s) in catalogue), series)
            assert base in catalogue, f"{series} (in {expr!r}) is not in docs/metrics.md"
            entry = catalogue[base]
            if base != series:
                assert entry.type == "histogram", f"{series}: {base} is a {entry.type}"
            else:
                assert entry.type != "histogram", f"{series} is a histogram: query its _bucket/_sum/_count"
            if entry.type == "counter":
                assert re.search(rf"(rate|increase)\({series}\[", expr), f"{series} is a counter: rate() it"
            used.add(base)
    for expr in expressions(dashboard):
        if "histogram_quantile" in expr:
            assert "_bucket[" in expr and "le" in expr, expr
    # The vital signs are on the dashboard.
    vitals = {"rlfleet_worker_episode_duration_seconds", "rlfleet_worker_tool_wait_seconds",
              "rlfleet_session_trajectory_tokens", "rlfleet_gateway_engine_busy_seconds_total",
              "rlfleet_gateway_engine_policy_version", "rlfleet_trainer_staleness_versions",
              "rlfleet_verifier_reward", "rlfleet_broker_pause_seconds", "rlfleet_queue_pending_messages",
              "rlfleet_trainer_idle_ratio"}
    assert vitals <= used, sorted(vitals - used)


def test_promtool_parses_every_dashboard_query(dashboard, tmp_path):
    promtool = h.tool("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": expr} for i, expr in enumerate(expressions(dashboard))]}]}
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
