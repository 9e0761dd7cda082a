"""Bad input at the edge: unknown enum values, large inputs echoed in errors, floods of bad requests."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor

from rlfleet.api.broker.v1 import broker_pb2
from rlfleet.api.gateway.v1 import gateway_pb2
from rlfleet.api.session.v1 import session_pb2
from rlfleet.common.errors import (
    InvalidArgument,
    NotFound,
    OncePerPeer,
    clip,
    require_known_enums,
    unknown_enum,
)
from rlfleet.common.rich_errors import rich_status


def test_unknown_enum_values_are_found_at_any_depth():
    assert unknown_enum(gateway_pb2.UpdateEngineStateRequest(state=gateway_pb2.ENGINE_STATE_DRAINING)) is None
    assert unknown_enum(gateway_pb2.UpdateEngineStateRequest(state=97)) == ("state", 97)
    nested = broker_pb2.StartDistributedSyncRequest()
    nested.version.format = 42
    assert unknown_enum(nested) == ("version.format", 42)
    with pytest.raises(InvalidArgument, match="status: 9 is not a known value") as raised:
        require_known_enums(session_pb2.CloseSessionRequest(session_id="s", status=9))
    assert rich_status(raised.value).code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_large_input_is_never_echoed_whole():
    huge = "s" * (4 << 20)
    error = NotFound(f"session {huge} does not exist", session_id=huge, field="session_id")
    status = rich_status(error)
    assert len(status.details) < 1000
    assert sum(len(v) for _, v in status.trailing_metadata) < 4000  # the rich details are clipped too
    assert clip("short") == "short" and "characters in all" in clip(huge)


def test_once_per_peer_logs_the_first_and_counts_the_rest():
    limiter = OncePerPeer(interval_s=60.0)
    assert limiter.should_log("10.0.0.1", now=0.0) == (True, 0)
    assert [limiter.should_log("10.0.0.1", now=t)[0] for t in (1.0, 2.0, 59.0)] == [False, False, False]
    assert limiter.should_log("10.0.0.2", now=3.0) == (True, 0)  # another peer is its own
    assert limiter.should_log("10.0.0.1", now=60.5) == (True, 3)  # and says how many it left out


def enum_rpcs():
    from rlfleet.api.broker.v1 import broker_pb2 as broker
    from rlfleet.api.common.v1 import common_pb2 as common
    from rlfleet.api.sandbox.v1 import sandbox_pb2 as sandbox
    from rlfleet.api.trainer.v1 import trainer_pb2 as trainer
    from rlfleet.api.verifier.v1 import verifier_pb2 as verifier

    found = []
    for module in (broker, gateway_pb2, sandbox, session_pb2, trainer, verifier, common):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                if _has_enum(method.input_type):
                    found.append(f"{service.full_name}/{method.name}")
    return found


def _has_enum(message, seen=()):
    for field in message.fields:
        if field.type == FieldDescriptor.TYPE_ENUM:
            return True
        if field.message_type is not None and field.message_type not in seen and _has_enum(
                field.message_type, (*seen, message)):
            return True
    return False


def test_every_rpc_with_an_enum_checks_it():
    """A new RPC with an enum must call require_known_enums: its servicer's source says so."""
    import inspect

    from rlfleet.broker.servicer import BrokerServicer
    from rlfleet.gateway.servicer import GatewayServicer
    from rlfleet.session.servicer import SessionServicer

    servicers = {"rlfleet.broker.v1.BrokerService": BrokerServicer,
                 "rlfleet.gateway.v1.GatewayService": GatewayServicer,
                 "rlfleet.session.v1.SessionService": SessionServicer}
    rpcs = enum_rpcs()
    assert "rlfleet.gateway.v1.GatewayService/UpdateEngineState" in rpcs
    for rpc in rpcs:
        service, method = rpc.split("/")
        assert service in servicers, f"{rpc} has an enum: check it with require_known_enums"
        source = inspect.getsource(getattr(servicers[service], method))
        assert "require_known_enums(request)" in source, rpc
