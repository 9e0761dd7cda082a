"""The worker's token from a file (a compose or Kubernetes secret) rather than its config."""

from __future__ import annotations

import pytest

from rlfleet.common.errors import StartupError
from rlfleet.envkit.worker import worker_token
from rlfleet.envkit.worker_config import WorkerConfig


def test_the_token_file_is_read_when_no_token_is_given(tmp_path):
    (tmp_path / "worker.token").write_text("rlf1.abc.def\n")
    assert worker_token(WorkerConfig(token_file=str(tmp_path / "worker.token"))) == "rlf1.abc.def"
    assert worker_token(WorkerConfig(token="given", token_file=str(tmp_path / "worker.token"))) == "given"
    assert worker_token(WorkerConfig()) == ""


def test_a_missing_token_file_is_a_startup_error_naming_it(tmp_path):
    with pytest.raises(StartupError, match="token_file"):
        worker_token(WorkerConfig(token_file=str(tmp_path / "absent.token")))
