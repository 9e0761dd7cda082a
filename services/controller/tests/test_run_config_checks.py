"""StartRun's config check: the run directory and run id a controller accepts."""

import json

import pytest

from rlfleet.common.errors import InvalidArgument
from rlfleet.controller.run_control import RunControl


def control(run_dir) -> RunControl:
    return RunControl(run_dir, "calc", store=None)  # type: ignore[arg-type]  # parse_config reads no state


@pytest.mark.parametrize("config", [{}, {"run_dir": ""}, {"run_id": "calc"}])
def test_a_config_without_a_run_dir_runs_in_the_controller_s(tmp_path, config):
    # examples/*.toml name no run_dir; `rlfleet run` sends its own resolved one, other clients may not.
    assert control(tmp_path / "run").parse_config(json.dumps(config)).run_dir == str(tmp_path / "run")


def test_a_relative_run_dir_is_the_controller_s_only_where_it_resolves_to_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert control(tmp_path / "run").parse_config(json.dumps({"run_dir": "run"})).run_dir == "run"
    with pytest.raises(InvalidArgument, match="run_dir 'elsewhere' is not this controller's") as refused:
        control(tmp_path / "run").parse_config(json.dumps({"run_dir": "elsewhere"}))
    assert refused.value.details["run_dir"] == str(tmp_path / "run")


def test_another_run_id_is_refused(tmp_path):
    with pytest.raises(InvalidArgument, match="run_id 'other' is not this platform's"):
        control(tmp_path).parse_config(json.dumps({"run_id": "other"}))
