"""The rollout-tier test harness (rlfleet.session.testing) refuses what it cannot do, by name."""

from __future__ import annotations

import pytest

from rlfleet.session.testing import Rollout


def test_a_session_server_needs_a_gateway_started_or_named(tmp_path):
    rollout = Rollout(tmp_path, "nats://127.0.0.1:1", "redis://127.0.0.1:1", tmp_path / "model", "run")
    with pytest.raises(RuntimeError, match="no gateway for the session server"):
        rollout.start_session_server()
    assert rollout.sessions == []  # nothing was started
