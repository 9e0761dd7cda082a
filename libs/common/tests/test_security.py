"""Transport security and access rules at the one server skeleton every service uses.

Every RPC in the generated descriptors has a rule; an unauthenticated caller is refused on every one;
an environment client's token is refused the platform's rights (naming the right); a plaintext client
cannot talk to a TLS server; a server no environment client calls demands a run certificate; a
revoked or foreign token is refused.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import stat

import grpc
import pytest
from google.protobuf import message_factory

from rlfleet.common import roles, security
from rlfleet.common.config import GrpcServerConfig
from rlfleet.common.grpc_server import GrpcServer, channel
from rlfleet.common.rich_errors import error_details
from rlfleet.common.service import placeholder_servicer
from rlfleet.common.testing import client_credentials

SERVICES = ("session", "sandbox", "verifier", "gateway", "broker", "trainer", "controller")


def api_modules(name: str):
    return (importlib.import_module(f"rlfleet.api.{name}.v1.{name}_pb2"),
            importlib.import_module(f"rlfleet.api.{name}.v1.{name}_pb2_grpc"))


def descriptor_methods() -> list[tuple[str, object]]:
    """(full method path, input message class) of every RPC in rlfleet's generated API."""
    found = []
    for name in SERVICES:
        pb2, _grpc_module = api_modules(name)
        for service in pb2.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                found.append((f"/{service.full_name}/{method.name}",
                              message_factory.GetMessageClass(method.input_type)))
    return found


METHODS = descriptor_methods()


def add_placeholders(server: GrpcServer, names: tuple[str, ...]) -> None:
    """Servicers whose every RPC answers UNIMPLEMENTED: a call that passes the access check says so."""
    for name in names:
        pb2, pb2_grpc = api_modules(name)
        service = next(iter(pb2.DESCRIPTOR.services_by_name.values()))
        base = getattr(pb2_grpc, f"{service.name}Servicer")
        adder = getattr(pb2_grpc, f"add_{service.name}Servicer_to_server")
        server.add(adder, placeholder_servicer(base, service.full_name, "test"), service.full_name)


@pytest.fixture
async def every_service():
    """One server with every service on it (so it takes token-only callers, as the session server does)."""
    server = GrpcServer(GrpcServerConfig())
    add_placeholders(server, SERVICES)
    port = await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop()


@pytest.fixture
async def admin_only():
    """The gateway alone: no environment client calls it, so it demands mutual TLS."""
    server = GrpcServer(GrpcServerConfig())
    add_placeholders(server, ("gateway",))
    port = await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop()


async def call(address: str, method: str, request_class, credentials=None, raw_channel=None):
    ch = raw_channel or channel(address, credentials=credentials)
    try:
        stub = ch.unary_unary(method, request_serializer=request_class.SerializeToString,
                              response_deserializer=lambda b: b)
        await stub(request_class(), timeout=10)
    except grpc.aio.AioRpcError as exc:
        return exc
    finally:
        await ch.close()
    return None


def ca_only() -> security.Credentials:
    """TLS with the run's CA and nothing else: no certificate, no token."""
    return security.Credentials(ca=(security.secrets_dir() / "ca.pem").read_bytes(), token="")


def test_every_rpc_in_the_descriptors_has_an_access_rule():
    assert {method for method, _ in METHODS} == set(roles.RULES)


@pytest.mark.parametrize(("method", "request_class"), METHODS, ids=[m for m, _ in METHODS])
async def test_an_unauthenticated_caller_is_refused_on_every_rpc(every_service, method, request_class):
    refused = await call(every_service, method, request_class, credentials=ca_only())
    assert refused is not None and refused.code() == grpc.StatusCode.UNAUTHENTICATED, refused
    assert error_details(refused).metadata["right"] == "authenticated"


async def test_a_token_of_another_run_key_is_refused(every_service, tmp_path):
    other = security.ensure_secrets(tmp_path / "other", "other")
    token, _ = security.issue_token(other, "other", "mallory")
    creds = security.client_credentials(token, ca_only().ca)
    refused = await call(every_service, "/rlfleet.session.v1.SessionService/GetSession",
                         METHODS[0][1], credentials=creds)
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED and "bad signature" in refused.details()


ADMIN_RIGHTS = ["/rlfleet.gateway.v1.GatewayService/RegisterEngine",
                "/rlfleet.gateway.v1.GatewayService/PauseEngines",
                "/rlfleet.gateway.v1.GatewayService/DeregisterEngine",
                "/rlfleet.trainer.v1.TrainerService/Pause",
                "/rlfleet.broker.v1.BrokerService/PublishVersion", "/rlfleet.broker.v1.BrokerService/Promote",
                "/rlfleet.broker.v1.BrokerService/Rollback", "/rlfleet.verifier.v1.VerifierService/Audit",
                "/rlfleet.controller.v1.RunControl/StartRun", "/rlfleet.controller.v1.RunControl/StopRun"]


@pytest.mark.parametrize("method", ADMIN_RIGHTS)
async def test_an_environment_client_is_denied_the_platforms_rights(every_service, method):
    request_class = dict(METHODS)[method]
    refused = await call(every_service, method, request_class, credentials=client_credentials("r1", "env"))
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
    details = error_details(refused)
    assert details.metadata["caller"] == "environment:env@r1" and "operator" in details.metadata["right"]
    assert "needs the right of" in refused.details()


async def test_an_environment_client_passes_the_check_on_its_own_rpcs(every_service):
    method = "/rlfleet.session.v1.SessionService/GetSession"
    answered = await call(every_service, method, dict(METHODS)[method], credentials=client_credentials("r1"))
    assert answered.code() == grpc.StatusCode.UNIMPLEMENTED  # the placeholder servicer ran


async def test_only_the_trainer_publishes_policy_versions(every_service):
    directory = security.secrets_dir()
    method = "/rlfleet.broker.v1.BrokerService/PublishVersion"
    request_class = dict(METHODS)[method]
    other = await call(every_service, method, request_class,
                       credentials=security.trusted_credentials(directory, "session-server"))
    assert other.code() == grpc.StatusCode.PERMISSION_DENIED and "service:trainer" in other.details()
    trainer = await call(every_service, method, request_class,
                         credentials=security.trusted_credentials(directory, "trainer"))
    assert trainer.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_a_plaintext_client_cannot_talk_to_a_tls_server(every_service):
    method = "/rlfleet.session.v1.SessionService/GetSession"
    plain = grpc.aio.insecure_channel(every_service)
    refused = await call(every_service, method, dict(METHODS)[method], raw_channel=plain)
    assert refused is not None and refused.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_server_no_environment_client_calls_demands_a_run_certificate(admin_only):
    method = "/rlfleet.gateway.v1.GatewayService/PauseEngines"
    request_class = dict(METHODS)[method]
    # A valid client token is not enough: the TLS handshake needs a certificate of the run's CA.
    refused = await call(admin_only, method, request_class, credentials=client_credentials("r1"))
    assert refused is not None and refused.code() == grpc.StatusCode.UNAVAILABLE
    # The run's own services get through the handshake and the rule.
    creds = security.trusted_credentials(security.secrets_dir(), "weight-broker")
    passed = await call(admin_only, method, request_class, credentials=creds)
    assert passed.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_a_revoked_token_is_refused_within_a_second(every_service):
    method = "/rlfleet.session.v1.SessionService/GetSession"
    request_class = dict(METHODS)[method]
    creds = client_credentials("r1", "revoked-soon")
    assert ((await call(every_service, method, request_class, credentials=creds)).code()
            == grpc.StatusCode.UNIMPLEMENTED)
    token_id = security.TokenBook.load(security.secrets_dir())._check(creds.token).token_id
    security.revoke_token(security.secrets_dir(), token_id)
    await asyncio.sleep(1.2)
    refused = await call(every_service, method, request_class, credentials=creds)
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in refused.details()
    assert next(t for t in security.list_tokens(security.secrets_dir()) if t["id"] == token_id)["revoked"]


def test_secrets_are_private_files(tmp_path):
    root = security.ensure_secrets(tmp_path / "secrets", "r1")
    security.identity_pem(root, "trainer")
    security.issue_token(root, "r1", "someone")
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    for path in [p for p in root.rglob("*") if p.is_file()]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    # The list of issued tokens holds ids, never a usable token.
    assert "rlf1." not in (root / "tokens.jsonl").read_text()


def test_a_bad_client_name_is_refused(tmp_path):
    root = security.ensure_secrets(tmp_path / "secrets", "r1")
    with pytest.raises(security.InvalidArgument):
        security.issue_token(root, "r1", "no spaces allowed")
