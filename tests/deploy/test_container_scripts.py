"""The scripts every image carries, run for real: rlfleet-healthcheck against a gRPC health
server and an HTTP endpoint, rlfleet-register-engine against a gateway that records calls."""

from __future__ import annotations

import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures

import deploy_helpers as h
import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rlfleet.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from rlfleet.common import security
from rlfleet.common.grpc_server import tls_server_credentials

HEALTHCHECK = h.DEPLOY / "docker" / "healthcheck.py"
REGISTER = h.DEPLOY / "docker" / "register_engine.py"


def run(script, *args, env=None, timeout=20):
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", tls_server_credentials(require_client_auth=True))
    server.start()
    yield servicer, port
    server.stop(0)


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        code = 200 if self.path in ("/health", "/health_generate") else 503
        self.send_response(code)
        self.end_headers()
        self.wfile.write(b"ok" if code == 200 else b"no")

    def log_message(self, *args):
        pass


@pytest.fixture
def http_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_healthcheck_passes_while_serving_and_fails_when_not(health_server):
    servicer, port = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    result = run(HEALTHCHECK, f"127.0.0.1:{port}")
    assert result.returncode == 0, result.stderr
    assert "healthy" in result.stderr
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    result = run(HEALTHCHECK, f"127.0.0.1:{port}")
    assert result.returncode == 1 and "NOT_SERVING" in result.stderr


def test_healthcheck_presents_the_one_certificate_a_container_has_and_needs_no_ca_key(
        health_server, tmp_path):
    """A compose container's secrets: the CA certificate, the token key and its own identity's
    certificate, made up front; the mutual-TLS server lets the health check in with that certificate."""
    servicer, port = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    run_secrets = security.secrets_dir()
    container = tmp_path / "secrets"
    (container / "certs").mkdir(parents=True)
    for name in ("ca.pem", "token.key"):
        (container / name).write_bytes((run_secrets / name).read_bytes())
    (container / "certs" / "verifier.pem").write_bytes(security.identity_pem(run_secrets, "verifier"))
    env = {**os.environ, security.SECRETS_ENV: str(container)}
    result = run(HEALTHCHECK, f"127.0.0.1:{port}", env=env)
    assert result.returncode == 0, result.stderr
    (container / "certs" / "verifier.pem").unlink()  # no certificate, no CA key: no credentials
    result = run(HEALTHCHECK, f"127.0.0.1:{port}", env=env)
    assert result.returncode == 1 and "no credentials" in result.stderr, result.stderr


def test_healthcheck_defaults_to_the_port_in_the_service_environment(health_server):
    servicer, port = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    env = {**os.environ, "RLFLEET__GRPC__PORT": str(port)}
    assert run(HEALTHCHECK, env=env).returncode == 0


def test_healthcheck_fails_fast_when_nothing_listens():
    started = time.monotonic()
    result = run(HEALTHCHECK, "127.0.0.1:1", "--timeout", "1")
    assert result.returncode == 1 and "UNAVAILABLE" in result.stderr
    assert time.monotonic() - started < 10


def test_healthcheck_over_http(http_server):
    assert run(HEALTHCHECK, "--http", f"{http_server}/health").returncode == 0
    result = run(HEALTHCHECK, "--http", f"{http_server}/missing")
    assert result.returncode == 1 and "HTTP 503" in result.stderr


class FakeGateway(gateway_pb2_grpc.GatewayServiceServicer):
    """Records registrations; answers UNIMPLEMENTED to the first `refuse` RegisterEngine calls."""

    def __init__(self, refuse: int = 0):
        self.engines: dict[str, gateway_pb2.RegisterEngineRequest] = {}
        self.registrations = 0
        self.deregistered: list[str] = []
        self.refuse = refuse
        self.lock = threading.Lock()

    def RegisterEngine(self, request, context):
        with self.lock:
            if self.refuse > 0:
                self.refuse -= 1
                context.abort(grpc.StatusCode.UNIMPLEMENTED, "not yet")
            self.engines[request.engine_id] = request
            self.registrations += 1
        return gateway_pb2.Engine(engine_id=request.engine_id, url=request.url, pool=request.pool,
                                  kind=request.kind, state=gateway_pb2.ENGINE_STATE_DRAINING)

    def ListEngines(self, request, context):
        with self.lock:
            return gateway_pb2.ListEnginesResponse(
                engines=[gateway_pb2.Engine(engine_id=e.engine_id, url=e.url) for e in self.engines.values()])

    def DeregisterEngine(self, request, context):
        with self.lock:
            self.engines.pop(request.engine_id, None)
            self.deregistered.append(request.engine_id)
        return gateway_pb2.DeregisterEngineResponse()


@pytest.fixture
def gateway(request):
    fake = FakeGateway(refuse=getattr(request, "param", 0))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    gateway_pb2_grpc.add_GatewayServiceServicer_to_server(fake, server)
    port = server.add_secure_port("127.0.0.1:0", tls_server_credentials(require_client_auth=True))
    server.start()
    yield fake, f"127.0.0.1:{port}"
    server.stop(0)


def wait_until(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_registrar_registers_once_healthy_re_registers_and_deregisters_on_sigterm(gateway, http_server):
    fake, address = gateway
    env = {**os.environ, "ENGINE_ID": "sglang-abc", "ENGINE_URL": http_server + "/",
           "GATEWAY_ADDRESS": address,
           "ENGINE_KIND": "sglang", "ENGINE_START_DRAINING": "true", "ENGINE_LABELS": '{"zone": "a"}'}
    proc = subprocess.Popen([sys.executable, str(REGISTER), "--interval", "0.2", "--label", "gpu=h100"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: "sglang-abc" in fake.engines), "never registered"
        request = fake.engines["sglang-abc"]
        assert request.url == http_server  # trailing slash dropped
        assert (request.kind == gateway_pb2.ENGINE_KIND_SGLANG
                and request.pool == gateway_pb2.ENGINE_POOL_FLEET)
        assert request.start_draining and dict(request.labels) == {"zone": "a", "gpu": "h100"}
        with fake.lock:
            fake.engines.clear()  # the registry lost it
        assert wait_until(lambda: "sglang-abc" in fake.engines), "not registered again"
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    assert fake.deregistered == ["sglang-abc"] and not fake.engines
    assert fake.registrations == 2


@pytest.mark.parametrize("gateway", [1], indirect=True)
def test_registrar_retries_a_gateway_that_is_not_ready_and_once_exits(gateway, http_server):
    fake, address = gateway
    result = run(REGISTER, "--gateway", address, "--engine-id", "cpu-engine-0", "--url", http_server,
                 "--kind", "cpu", "--pool", "canary", "--once", timeout=30)
    assert result.returncode == 0, result.stderr
    assert "retrying" in result.stderr
    request = fake.engines["cpu-engine-0"]
    assert request.kind == gateway_pb2.ENGINE_KIND_CPU and request.pool == gateway_pb2.ENGINE_POOL_CANARY
    assert fake.deregistered == []


def test_registrar_waits_for_the_engine_before_registering(gateway):
    fake, address = gateway
    proc = subprocess.Popen([sys.executable, str(REGISTER), "--gateway", address, "--engine-id", "e0",
                             "--url", "http://127.0.0.1:1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        time.sleep(1.5)
        assert not fake.engines
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and fake.deregistered == []


def test_registrar_needs_a_gateway_an_engine_id_and_a_url():
    env = {k: v for k, v in os.environ.items() if k not in ("GATEWAY_ADDRESS", "ENGINE_ID", "ENGINE_URL")}
    result = run(REGISTER, "--engine-id", "e0", env=env)
    assert result.returncode == 2 and "--gateway, --url required" in result.stderr
