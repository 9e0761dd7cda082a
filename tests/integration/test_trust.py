"""The attacks of issue 20 replayed against real processes (engine, gateway, session server,
verifier, sandbox manager), each refused with the right status.

- another client reads, drives, verifies or closes a victim's session: NOT_FOUND, as if it did not
  exist, and the victim's close carries no forged verdict;
- a token for another run sees nothing of this run;
- an environment client cannot even complete the TLS handshake with the gateway (RegisterEngine,
  PauseEngines, DeregisterEngine are services' and operators' rights);
- another client's sandbox is NOT_FOUND;
- the engine's admin routes want the admin key; a disk load outside the weight store is refused;
  an engine without a weight-store root does not start;
- a token revoked on one host is refused by a service on another (its own copy of the secrets),
  through the run's Redis.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time

import grpc
import pytest

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from rlfleet.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from rlfleet.api.session.v1 import session_pb2 as pb
from rlfleet.api.session.v1 import session_pb2_grpc
from rlfleet.api.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from rlfleet.common import revocations, security
from rlfleet.common.grpc_server import channel
from rlfleet.common.processes import ProcessNotReady, ServiceProcess
from rlfleet.common.testing import client_credentials, unique_run_id
from rlfleet.engine.testing import auth_headers, http_call, tiny_model
from rlfleet.sandbox.testing import start_sandbox_manager
from rlfleet.session.testing import Rollout

pytestmark = [pytest.mark.integration, pytest.mark.slow]
NEEDS_BWRAP = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("bwrap"),
                                 reason="needs root and bubblewrap")


@pytest.fixture(scope="module")
def stack(nats_url, redis_url, tmp_path_factory):
    model = tiny_model(tmp_path_factory.getbasetemp() / "models")
    workdir = tmp_path_factory.mktemp("trust")
    rollout = Rollout(workdir, nats_url, redis_url, model, unique_run_id("trust")).start(engines=1)
    verifier = None
    (workdir / "suites").mkdir()
    try:
        verifier = ServiceProcess("rlfleet-verifier", workdir, config={
            "redis.url": redis_url, "run_id": rollout.run_id, "session_address": rollout.session.address,
            "suites_dir": str(workdir / "suites")}).start(30.0)
        rollout.verifier = verifier
        yield rollout
    finally:
        if verifier is not None:
            verifier.stop()
        rollout.stop()


def chat() -> common_pb2.ChatMessages:
    return common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="user", content="What is 2+3?")])


async def open_session(address: str, creds, run_id: str) -> str:
    async with channel(address, credentials=creds) as ch:
        opened = await session_pb2_grpc.SessionServiceStub(ch).OpenSession(pb.OpenSessionRequest(
            run_id=run_id, task_id="calc-1", messages=chat(),
            sampling=common_pb2.SamplingParams(max_new_tokens=4)), timeout=30)
    return opened.session_id


async def refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


async def test_another_client_cannot_touch_or_verify_a_victims_session(stack):
    victim, attacker = (client_credentials(stack.run_id, "victim"),
                        client_credentials(stack.run_id, "attacker"))
    session_id = await open_session(stack.session.address, victim, stack.run_id)
    assert len(session_id) == 32  # generated: 128 random bits, not `{task}-{seq}-s{i}`
    async with channel(stack.session.address, credentials=attacker) as ch, \
            channel(stack.verifier.address, credentials=attacker) as vch:
        sessions = session_pb2_grpc.SessionServiceStub(ch)
        for call in (sessions.GetSession(pb.GetSessionRequest(session_id=session_id)),
                     sessions.AppendObservation(pb.AppendObservationRequest(session_id=session_id, text="x")),
                     sessions.Generate(pb.GenerateRequest(session_id=session_id)),
                     sessions.CloseSession(pb.CloseSessionRequest(
                         session_id=session_id, status=common_pb2.TRAJECTORY_STATUS_COMPLETED))):
            assert (await refused(call)).code() == grpc.StatusCode.NOT_FOUND
        # The forged verdict: the verifier reads the session as the asking client, who does not own it.
        forged = await refused(verifier_pb2_grpc.VerifierServiceStub(vch).Verify(verifier_pb2.VerifyRequest(
            session_id=session_id, suite="code", files={"solution.py": b"print('PASS')"}), timeout=30))
        assert forged.code() == grpc.StatusCode.NOT_FOUND and "session" in forged.details()
        verdict = await refused(verifier_pb2_grpc.VerifierServiceStub(vch).GetVerdict(
            verifier_pb2.GetVerdictRequest(session_id=session_id)))
        assert verdict.code() == grpc.StatusCode.NOT_FOUND
    async with channel(stack.session.address, credentials=victim) as ch:
        sessions = session_pb2_grpc.SessionServiceStub(ch)
        assert (await sessions.GetSession(pb.GetSessionRequest(session_id=session_id))).session_id == \
            session_id
        closed = await sessions.CloseSession(pb.CloseSessionRequest(
            session_id=session_id, status=common_pb2.TRAJECTORY_STATUS_COMPLETED))
    assert closed.verdict_missing and not closed.verdict.passed  # no forged verdict reached the trajectory


async def test_a_token_for_another_run_sees_nothing_of_this_run(stack):
    session_id = await open_session(stack.session.address,
                                    client_credentials(stack.run_id, "same-name"), stack.run_id)
    other_run = client_credentials("some-other-run", "same-name")  # same client name, another run
    async with channel(stack.session.address, credentials=other_run) as ch:
        sessions = session_pb2_grpc.SessionServiceStub(ch)
        assert (await refused(sessions.GetSession(pb.GetSessionRequest(session_id=session_id)))).code() == \
            grpc.StatusCode.NOT_FOUND
        opened = await refused(sessions.OpenSession(pb.OpenSessionRequest(run_id="", task_id="t",
                                                                          messages=chat())))
        assert opened.code() == grpc.StatusCode.PERMISSION_DENIED and stack.run_id in opened.details()


async def test_a_client_claiming_a_victims_session_id_first_is_refused(stack):
    attacker = client_credentials(stack.run_id, "squatter")
    async with channel(stack.session.address, credentials=attacker) as ch:
        sessions = session_pb2_grpc.SessionServiceStub(ch)
        request = pb.OpenSessionRequest(session_id="predicted-id-1", run_id=stack.run_id, task_id="t",
                                        messages=chat(), sampling=common_pb2.SamplingParams(max_new_tokens=4))
        await sessions.OpenSession(request, timeout=30)
    async with channel(stack.session.address, credentials=client_credentials(stack.run_id, "owner")) as ch:
        taken = await refused(session_pb2_grpc.SessionServiceStub(ch).OpenSession(request, timeout=30))
    assert taken.code() == grpc.StatusCode.ALREADY_EXISTS  # never the squatter's session handed over


async def test_an_environment_client_cannot_register_pause_or_deregister_engines(stack):
    creds = client_credentials(stack.run_id, "fake-engine")
    async with channel(stack.gateway.address, credentials=creds) as ch:
        gateway = gateway_pb2_grpc.GatewayServiceStub(ch)
        for call in (gateway.RegisterEngine(gateway_pb2.RegisterEngineRequest(
                         engine_id="evil", url="http://127.0.0.1:9"), timeout=10),
                     gateway.PauseEngines(gateway_pb2.PauseEnginesRequest(), timeout=10),
                     gateway.DeregisterEngine(gateway_pb2.DeregisterEngineRequest(engine_id="e0"),
                                              timeout=10)):
            # The gateway demands a run certificate in the TLS handshake: a token alone never gets a call in.
            assert (await refused(call)).code() == grpc.StatusCode.UNAVAILABLE
    async with channel(stack.gateway.address) as ch:  # the operator's certificate: the engine is still there
        engines = await gateway_pb2_grpc.GatewayServiceStub(ch).ListEngines(gateway_pb2.ListEnginesRequest())
    assert [e.engine_id for e in engines.engines] == ["e0"]


async def test_the_engines_admin_routes_want_the_admin_key(stack):
    url = stack.engines["e0"].url
    body = {"new_version": "666"}
    import aiohttp

    async with aiohttp.ClientSession() as http:
        for headers in ({}, auth_headers("/generate"), {"Authorization": "Bearer guess"}):
            async with http.post(url + "/update_weight_version", json=body, headers=headers) as reply:
                assert reply.status == 401, headers
        async with http.post(url + "/generate", json={"input_ids": [1]}) as reply:
            assert reply.status == 401  # the API key guards generation too
    status, reply = await http_call(url, "/update_weights_from_disk", {"model_path": "/etc"})
    assert status == 403 and "outside the weight store root" in reply["message"]
    status, info = await http_call(url, "/model_info", method="GET")
    assert info["weight_version"] == "0"


def test_an_engine_without_a_weight_store_root_does_not_start(stack, tmp_path):
    engine = ServiceProcess("rlfleet-cpu-engine", tmp_path, config={"model_path": str(stack.model)})
    with pytest.raises(ProcessNotReady) as caught:
        engine.start(60.0)
    assert "weight-store-root" in str(caught.value)


@NEEDS_BWRAP
async def test_another_clients_sandbox_is_not_found(redis_url, tmp_path):
    run_id = unique_run_id("trustbox")
    manager = start_sandbox_manager(redis_url, run_id, tmp_path)
    try:
        async with channel(manager.address, credentials=client_credentials(run_id, "owner")) as ch:
            box = await sandbox_pb2_grpc.SandboxServiceStub(ch).CreateSandbox(
                sandbox_pb2.CreateSandboxRequest(), timeout=30)
        async with channel(manager.address, credentials=client_credentials(run_id, "other")) as ch:
            stub = sandbox_pb2_grpc.SandboxServiceStub(ch)
            for call in (stub.GetSandbox(sandbox_pb2.GetSandboxRequest(sandbox_id=box.sandbox_id)),
                         stub.Exec(sandbox_pb2.ExecRequest(sandbox_id=box.sandbox_id, argv=["true"])),
                         stub.ReadFiles(sandbox_pb2.ReadFilesRequest(sandbox_id=box.sandbox_id, paths=["a"])),
                         stub.DestroySandbox(sandbox_pb2.DestroySandboxRequest(sandbox_id=box.sandbox_id))):
                assert (await refused(call)).code() == grpc.StatusCode.NOT_FOUND
        async with channel(manager.address, credentials=client_credentials("another-run", "owner")) as ch:
            stub = sandbox_pb2_grpc.SandboxServiceStub(ch)  # the same name in another run is someone else
            assert (await refused(stub.GetSandbox(
                sandbox_pb2.GetSandboxRequest(sandbox_id=box.sandbox_id)))).code() \
                == grpc.StatusCode.NOT_FOUND
            assert (await refused(stub.CreateSandbox(sandbox_pb2.CreateSandboxRequest()))).code() == \
                grpc.StatusCode.PERMISSION_DENIED
        async with channel(manager.address, credentials=client_credentials(run_id, "owner")) as ch:
            stub = sandbox_pb2_grpc.SandboxServiceStub(ch)
            assert (await stub.GetSandbox(
                sandbox_pb2.GetSandboxRequest(sandbox_id=box.sandbox_id))).sandbox_id
            await stub.DestroySandbox(sandbox_pb2.DestroySandboxRequest(sandbox_id=box.sandbox_id))
    finally:
        manager.stop()


async def test_a_revocation_reaches_a_service_with_its_own_copy_of_the_secrets(redis_url, tmp_path):
    """As in compose or Kubernetes: the verifier has its own copy of the secrets (the CA certificate,
    the token key, its certificate; no revoked file, no shared volume) and still refuses a token
    revoked elsewhere, through the run's Redis, within a few seconds."""
    run_id = unique_run_id("revoke")
    origin = security.secrets_dir()
    mount = tmp_path / "mount"
    (mount / "certs").mkdir(parents=True)
    for name in ("ca.pem", "token.key"):
        shutil.copy(origin / name, mount / name)
    (mount / "certs" / "verifier.pem").write_bytes(security.identity_pem(origin, "verifier"))
    (tmp_path / "suites").mkdir()
    verifier = ServiceProcess("rlfleet-verifier", tmp_path, config={
        "redis.url": redis_url, "run_id": run_id, "session_address": "127.0.0.1:1",
        "suites_dir": str(tmp_path / "suites")},
        env={**os.environ, security.SECRETS_ENV: str(mount)}).start(30.0)
    try:
        creds = client_credentials(run_id, "soon-revoked")
        token_id = security.TokenBook.load(origin).verify(creds.token).token_id
        async with channel(verifier.address, credentials=creds) as ch:
            stub = verifier_pb2_grpc.VerifierServiceStub(ch)
            request = verifier_pb2.GetVerdictRequest(session_id="no-such-session")
            assert (await refused(stub.GetVerdict(request, timeout=10))).code() == grpc.StatusCode.NOT_FOUND
            security.revoke_token(origin, token_id)  # this host's record ...
            revocations.publish_ids(redis_url, {}, run_id, [token_id])  # ... and every host's
            deadline = time.monotonic() + 10
            while True:
                error = await refused(stub.GetVerdict(request, timeout=10))
                if error.code() == grpc.StatusCode.UNAUTHENTICATED or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in error.details()
        assert not (mount / "revoked").exists()  # it learnt it from Redis, not from the file
    finally:
        verifier.stop()
