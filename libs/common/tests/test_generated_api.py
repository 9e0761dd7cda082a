import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_committed_generated_code_matches_what_proto_would_generate():
    result = subprocess.run([sys.executable, str(ROOT / "scripts/gen_proto.py"), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_proto_package_mirrors_its_directory():
    for proto in (ROOT / "proto").rglob("*.proto"):
        rel = proto.relative_to(ROOT / "proto").parent
        package = next(line for line in proto.read_text().splitlines() if line.startswith("package "))
        assert package == f"package {'.'.join(rel.parts)};", proto


def test_generated_modules_import_under_rlfleet_api():
    from rlfleet.api.broker.v1 import broker_pb2_grpc
    from rlfleet.api.common.v1 import common_pb2
    from rlfleet.api.session.v1 import session_pb2

    assert session_pb2.OpenSessionRequest.DESCRIPTOR.fields_by_name["messages"].message_type.full_name == \
        "rlfleet.common.v1.ChatMessages"
    assert common_pb2.Trajectory.DESCRIPTOR.full_name == "rlfleet.common.v1.Trajectory"
    assert hasattr(broker_pb2_grpc, "BrokerServiceStub")
