"""scripts/megatron_bridge_wheel.py: only the declared dependencies and the version change."""

import importlib.util
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "megatron_bridge_wheel.py"


def load_script():
    spec = importlib.util.spec_from_file_location("megatron_bridge_wheel", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_metadata_keeps_everything_but_the_requirements_and_marks_the_version():
    script = load_script()
    upstream = ("Metadata-Version: 2.4\nName: megatron-bridge\nVersion: 0.3.1\n"
                "Requires-Dist: transformers<5.0.0\nRequires-Dist: transformer-engine[pytorch]<2.13.0\n"
                "Requires-Python: >=3.10\n\n# Megatron Bridge\n")
    out = script._metadata(upstream)
    head, body = out.split("\n\n", 1)
    assert body == "# Megatron Bridge\n"
    assert "Version: 0.3.1+rlfleet" in head and "Requires-Python: >=3.10" in head
    declared = [line.removeprefix("Requires-Dist: ") for line in head.splitlines()
                if line.startswith("Requires-Dist")]
    assert declared == list(script.REQUIRES) and "transformers" in declared
    assert not any("transformer-engine" in d or "<5" in d for d in declared)


def test_a_wheel_that_is_not_the_upstream_one_is_refused(tmp_path):
    fake = tmp_path / "megatron_bridge-0.3.1-py3-none-any.whl"
    with zipfile.ZipFile(fake, "w") as z:
        z.writestr("megatron_bridge-0.3.1.dist-info/METADATA", "Name: megatron-bridge\nVersion: 0.3.1\n\n")
    with pytest.raises(SystemExit, match="sha256"):
        load_script().rewrite(fake, tmp_path / "out")
