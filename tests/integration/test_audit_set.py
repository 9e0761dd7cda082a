"""The labelled audit set through `rlfleet-verifier audit`, with a real sandbox manager: the verifier
must agree with every true label (no false positives, no false negatives) in every suite."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import Counter

import pytest

from rlfleet.common.processes import BIN
from rlfleet.common.testing import unique_run_id
from rlfleet.sandbox.testing import start_sandbox_manager
from rlfleet.verifier import audit_set
from rlfleet.verifier.hacks import HACKS
from rlfleet.verifier.kinds import AuditReport

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("bwrap"), reason="needs root and bubblewrap"),
]


def test_the_audit_set_has_a_few_hundred_episodes_of_each_kind(tmp_path):
    suites, labels_file = audit_set.write(tmp_path)
    labels = [json.loads(line) for line in labels_file.read_text().splitlines()]
    kinds = Counter((label["suite"], label["human_passed"]) for label in labels)
    assert len(labels) >= 300 and min(kinds.values()) >= 30, kinds
    assert sum(label["episode_id"].startswith("code-hack-") for label in labels) == len(HACKS) * len(
        audit_set.HACKED_TEMPLATES)
    assert sorted(p.name for p in suites.iterdir()) == ["calc.jsonl", "code.jsonl"]


def test_rates_and_breaches_per_suite():
    report = AuditReport(n=10, tp=4, fp=1, tn=4, fn=1, by_suite={
        "calc": AuditReport(n=5, tp=2, fp=0, tn=3, fn=0), "code": AuditReport(n=5, tp=2, fp=1, tn=1, fn=1)})
    rates = audit_set.audit_rates(report)
    assert rates[""].false_positive_rate == 0.2 and rates["code"].false_positive_rate == 0.5
    assert rates["calc"].disagreement_rate == 0.0 and rates["code"].disagreement_rate == 0.4
    assert audit_set.audit_breaches(report, 0.3, 1.0) == [
        "the verifier passes 50.0% of the failing episodes of suite 'code' (max 30.0%)"]
    assert audit_set.audit_breaches(report, 1.0, 1.0) == []


def test_the_verifier_agrees_with_every_label_of_the_audit_set(redis_url, tmp_path):
    audit_set.write(tmp_path / "set")
    manager = start_sandbox_manager(redis_url, unique_run_id("audit"), tmp_path)
    try:
        done = subprocess.run(
            [str(BIN / "rlfleet-verifier"), "audit", "--audit-set", str(tmp_path / "set"),
             "--sandbox-address", manager.address, "--json", "--max-false-positive-rate", "0",
             "--max-false-negative-rate", "0"],
            capture_output=True, text=True, timeout=900)
    finally:
        assert manager.stop() == 0
    report = json.loads(done.stdout)
    print(json.dumps({k: v for k, v in report.items() if k != "disagreements"}, indent=1))
    assert done.returncode == 0, (done.stderr[-3000:], report["disagreements"][:10])
    assert (report["false_positives"], report["false_negatives"]) == (0, 0)
    assert set(report["suites"]) == {"calc", "code"} and report["n"] >= 300
