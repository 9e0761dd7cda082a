"""NATS and Redis speak TLS only, as the launcher starts them: a plaintext client is refused, and
Redis also refuses a TLS client without a certificate of the run's CA (mutual TLS)."""

from __future__ import annotations

import json
import socket
import ssl
from urllib.parse import urlparse

import pytest
import redis
import redis.asyncio as aioredis

from rlfleet.common import security
from rlfleet.common.config import NatsConfig, RedisConfig
from rlfleet.common.errors import StartupError
from rlfleet.common.redis_store import connect_redis
from rlfleet.common.streams import connect_nats
from rlfleet.common.testing import HARNESS_USER, without_login


def _address(url: str) -> tuple[str, int]:
    parsed = urlparse(url)
    return parsed.hostname or "127.0.0.1", parsed.port or 0


def _read_all(sock: socket.socket) -> bytes:
    received = b""
    try:
        while chunk := sock.recv(4096):
            received += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return received


def test_a_plaintext_nats_client_is_refused(nats_url, infra_secrets):
    """The right login in plaintext: the server tells it TLS is required and never answers its PING."""
    assert nats_url.startswith("tls://")
    credential = infra_secrets.nats[HARNESS_USER]
    with socket.create_connection(_address(nats_url), timeout=3) as sock:
        info = sock.recv(4096)
        assert info.startswith(b"INFO ") and json.loads(info[5:])["tls_required"] is True
        connect = {"user": credential.user, "pass": credential.password, "verbose": False, "protocol": 1}
        sock.sendall(b"CONNECT " + json.dumps(connect).encode() + b"\r\nPING\r\n")
        sock.settimeout(3)
        answer = _read_all(sock)
    assert b"PONG" not in answer
    assert b"TLS" in answer or answer == b""


async def test_nats_over_a_plaintext_url_is_refused_and_tls_gets_in(nats_url):
    plain = "nats://" + nats_url.split("://", 1)[1]
    with pytest.raises(StartupError, match="cannot connect to NATS"):
        # nats-py without a TLS context of the run's CA: the handshake fails on the server's certificate
        await connect_nats(NatsConfig(url=plain, connect_timeout_s=2), "t-plain")
    nc = await connect_nats(NatsConfig(url=nats_url), "t-tls")
    try:
        assert nc.is_connected and nc.connected_url.scheme == "tls"
        await nc.jetstream().account_info()
    finally:
        await nc.close()


def test_a_plaintext_redis_client_is_refused(redis_url, infra_secrets):
    """Redis has no plaintext port (`port 0`): the right password in plaintext gets no answer."""
    assert redis_url.startswith("rediss://")
    credential = infra_secrets.redis[HARNESS_USER]
    with socket.create_connection(_address(redis_url), timeout=3) as sock:
        sock.sendall(f"AUTH {credential.user} {credential.password}\r\nPING\r\n".encode())
        sock.settimeout(3)
        answer = _read_all(sock)
    assert b"+OK" not in answer and b"PONG" not in answer
    plain = redis.Redis(*_address(redis_url), username=credential.user, password=credential.password,
                        socket_timeout=3, socket_connect_timeout=3)
    with pytest.raises(redis.exceptions.ConnectionError):
        plain.ping()
    plain.close()


async def test_redis_refuses_a_tls_client_without_a_certificate(redis_url, infra_secrets):
    credential = infra_secrets.redis[HARNESS_USER]
    ca = (security.secrets_dir() / "ca.pem").read_text()
    host, port = _address(redis_url)
    anonymous = aioredis.Redis(host=host, port=port, ssl=True, ssl_ca_data=ca, username=credential.user,
                               password=credential.password, socket_timeout=3, socket_connect_timeout=3)
    with pytest.raises((redis.exceptions.ConnectionError, ssl.SSLError, OSError)):
        await anonymous.ping()
    await anonymous.aclose()
    # NATS's certificate is for serving only: it is no client certificate, for Redis or for gRPC
    as_nats = aioredis.Redis(host=host, port=port, ssl=True, ssl_ca_data=ca, username=credential.user,
                             password=credential.password, socket_timeout=3, socket_connect_timeout=3,
                             ssl_certfile=str(security.secrets_dir() / "certs" / "nats.pem"))
    with pytest.raises((redis.exceptions.ConnectionError, ssl.SSLError, OSError)):
        await as_nats.ping()
    await as_nats.aclose()


async def test_connect_redis_speaks_mutual_tls_with_the_process_certificate(redis_url, infra_secrets):
    credential = infra_secrets.redis[HARNESS_USER]
    # the URL without the harness's ssl_* query: the certificate comes from this process's credentials
    bare = without_login(redis_url).split("?", 1)[0]
    client = await connect_redis(RedisConfig(url=bare, **credential.redis()))
    try:
        assert await client.ping()
        assert issubclass(client.connection_pool.connection_class, aioredis.SSLConnection)
    finally:
        await client.aclose()
    with pytest.raises(StartupError, match="cannot reach Redis"):
        await connect_redis(RedisConfig(url="redis://" + bare.split("://", 1)[1], connect_timeout_s=2,
                                        **credential.redis()))


async def test_pooled_redis_connections_share_one_context_that_trusts_only_the_run_ca(
        redis_url, infra_secrets):
    """A pool that grows under concurrent commands reuses one SSL context (building one per
    connection blocked the event loop), and that context still checks what redis-py's did."""
    import asyncio

    credential = infra_secrets.redis[HARNESS_USER]
    bare = without_login(redis_url).split("?", 1)[0]
    client = await connect_redis(RedisConfig(url=bare, **credential.redis()))
    try:
        pool = client.connection_pool
        await asyncio.gather(*(client.blpop(f"rlfleet:tls-test:{i}", timeout=0.2) for i in range(6)))
        connections = [*pool._available_connections, *pool._in_use_connections]
        assert len(connections) >= 6  # the blocking pops held a connection each
        contexts = {id(c.ssl_context.get()) for c in connections}
        assert len(contexts) == 1
        context = connections[0].ssl_context.get()
        assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
        run_ca = ssl.PEM_cert_to_DER_cert(security.local_credentials().ca.decode())
        assert context.get_ca_certs(binary_form=True) == [run_ca]  # not the system bundle too
        # One DriverInfo for the pool: redis-py would look its own version up per connection.
        assert len({id(c.driver_info) for c in connections}) == 1
        assert connections[0].driver_info.formatted_name == "redis-py"
        assert connections[0].driver_info.lib_version == redis.__version__
    finally:
        await client.aclose()


async def test_a_client_refuses_a_server_of_another_ca(tmp_path, nats_url):
    """The client side checks the server too: against another run's CA the handshake fails."""
    other = security.ensure_secrets(tmp_path / "other", "other")
    with pytest.raises(StartupError, match="(?i)certificate|cannot connect"):
        await connect_nats(NatsConfig(url=nats_url, connect_timeout_s=2, ca_file=str(other / "ca.pem")),
                           "t-other")
