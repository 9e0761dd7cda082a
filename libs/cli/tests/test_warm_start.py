import json
import sys

import pytest

from rlfleet.cli.warm_start import _run
from rlfleet.common.errors import StartupError


def test_a_build_step_tells_its_progress_lines_and_logs_everything(tmp_path):
    records = [{"epoch": 1, "epochs": 3, "step": 6, "steps": 189, "loss": 1.2345, "elapsed_s": 61.0},
               {"epoch": 3, "epochs": 3, "step": 189, "steps": 189, "loss": 0.5, "elapsed_s": 900.4}]
    script = "; ".join(["import json"]
                       + [f"print(json.dumps({{'progress': {r!r}}}), flush=True)" for r in records]
                       + ["print('{\"samples\": 2000}')"])
    log, said = tmp_path / "warm-start.log", []
    _run([sys.executable, "-c", script], log, "the SFT warm start", 1, say=said.append)
    assert said == ["base policy: SFT epoch 1/3, step 6/189, loss 1.234, 61 s",
                    "base policy: SFT epoch 3/3, step 189/189, loss 0.500, 900 s"]
    lines = log.read_text().splitlines()
    assert [json.loads(line) for line in lines[:2]] == [{"progress": r} for r in records]
    assert lines[2] == '{"samples": 2000}'


def test_a_failed_build_step_is_named_with_the_tail_of_its_log(tmp_path):
    log = tmp_path / "warm-start.log"
    with pytest.raises(StartupError, match=r"the SFT warm start failed \(exit 3\): .*out of data"):
        _run([sys.executable, "-c", "import sys; print('out of data'); sys.exit(3)"], log,
             "the SFT warm start", 1)
    assert "out of data" in log.read_text()
