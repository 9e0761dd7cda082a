"""The pytest plugin of every package's tests: real `nats-server -js` and `redis-server` on free
ports, one each per test session, stopped by PID.

Registered by the root conftest (`pytest_plugins`), so any test can ask for `nats_url` and
`redis_url`. Both servers run secured as `rlfleet up` starts them (NATS users with per-subject
permissions, Redis ACL users, `default` off: rlfleet.common.infra_auth); the URLs carry the
harness user's login, and `infra_secrets` has every service user's, for tests that act as one. It
imports pytest, which is in rlfleet-common's `testing` extra; the process harness itself
(`rlfleet.common.processes`) needs no pytest and is what benchmarks and the launcher use.
"""

from __future__ import annotations

import os
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, urlencode

import pytest

from rlfleet.common import security
from rlfleet.common.infra_auth import (
    Credential,
    InfraSecrets,
    ensure_infra_secrets,
    nats_authorization,
    redis_acl,
    write_secret,
)
from rlfleet.common.processes import NatsServer, RedisServer, start_nats, start_redis

HARNESS_USER = "harness"  # the tests' own login for NATS and Redis: may do anything, exists only here


@pytest.fixture(scope="session", autouse=True)
def rlfleet_secrets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run's secrets (CA, certificates, token key) for the whole test session, in the
    environment every server, client and child process reads: tests go over TLS with tokens, as a
    platform does, and need nothing set up by hand. In-process clients call as the operator."""
    return security.ensure_local_credentials(tmp_path_factory.mktemp("secrets"))


def client_credentials(run_id: str, name: str = "client") -> security.Credentials:
    """An environment client's credentials for `run_id`: the CA and a freshly issued token, as
    `rlfleet token issue` gives a client (pass to `channel(address, credentials=...)`)."""
    directory = security.secrets_dir()
    assert directory is not None, "the rlfleet_secrets fixture sets the secrets directory"
    token, _record = security.issue_token(directory, run_id, name)
    return security.client_credentials(token, (directory / "ca.pem").read_bytes())


def client_env(run_id: str, name: str = "client") -> dict[str, str]:
    """The environment a child process runs as an environment client with (RLFLEET_TOKEN, CA file)."""
    creds = client_credentials(run_id, name)
    directory = security.secrets_dir()
    assert directory is not None, "the rlfleet_secrets fixture sets the secrets directory"
    return {security.TOKEN_ENV: creds.token, security.CA_ENV: str(directory / "ca.pem")}


@pytest.fixture(scope="session")
def infra_secrets(tmp_path_factory: pytest.TempPathFactory) -> InfraSecrets:
    """The session's NATS and Redis users and passwords (files, mode 0600), as `rlfleet up` makes them."""
    return ensure_infra_secrets(tmp_path_factory.mktemp("secrets"), extra_nats=(HARNESS_USER,),
                                extra_redis=(HARNESS_USER,))


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory, infra_secrets: InfraSecrets,
                rlfleet_secrets: Path) -> Iterator[NatsServer]:
    """NATS with the services' users and their subject permissions, TLS only (the session's CA);
    nobody gets in without a login."""
    server = start_nats(tmp_path_factory.mktemp("nats"),
                        tls=security.server_tls_files(rlfleet_secrets, "nats"),
                        authorization=nats_authorization(infra_secrets, superusers=(HARNESS_USER,)))
    yield server
    server.stop(10)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory, infra_secrets: InfraSecrets,
                 rlfleet_secrets: Path) -> Iterator[RedisServer]:
    """Redis with the services' ACL users, `default` off, mutual TLS only (no plaintext port)."""
    directory = tmp_path_factory.mktemp("redis")
    aclfile = directory / "users.acl"
    write_secret(aclfile, redis_acl(infra_secrets, superusers=(HARNESS_USER,)))
    server = start_redis(directory, aclfile=aclfile, tls=security.server_tls_files(rlfleet_secrets, "redis"))
    yield server
    server.stop(10)


@pytest.fixture(scope="session")
def nats_url(nats_server: NatsServer, infra_secrets: InfraSecrets) -> str:
    """The secured NATS, logged in as the harness user (the login rides in the URL)."""
    return with_login(nats_server.url, infra_secrets.nats[HARNESS_USER])


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer, infra_secrets: InfraSecrets, rlfleet_secrets: Path) -> str:
    """The TLS Redis as the harness user. The URL also names the CA and the operator's certificate
    (redis-py reads ssl_* from the query), so a test's own `Redis.from_url(redis_url)` works as is;
    services connect by `connect_redis`, which takes them from the process's credentials."""
    security.identity_pem(rlfleet_secrets, "operator")
    tls = urlencode({"ssl_ca_certs": str(rlfleet_secrets / "ca.pem"),
                     "ssl_certfile": str(rlfleet_secrets / "certs" / "operator.pem")})
    return f"{with_login(redis_server.url, infra_secrets.redis[HARNESS_USER])}?{tls}"


def nats_tls() -> ssl.SSLContext:
    """What a test's own `nats.connect(nats_url, tls=...)` needs for the harness's TLS-only NATS."""
    return security.client_ssl_context()


def with_login(url: str, credential: Credential) -> str:
    """`scheme://user:password@host...`: how tests hand a login to code that takes only a URL."""
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{quote(credential.user)}:{quote(credential.password)}@{rest.split('@')[-1]}"


def without_login(url: str) -> str:
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{rest.split('@')[-1]}"


def unique_run_id(prefix: str = "t") -> str:
    """A run ID no other test uses, so tests sharing one NATS/Redis never see each other's data."""
    return f"{prefix}{os.getpid()}{time.monotonic_ns() % 10**9}"


class BackgroundRun:
    """A long command (an `rlfleet run`) in the background, its output collected line by line, so a
    test can watch it, kill what it starts, and show the end of its output when an assertion fails."""

    def __init__(self, argv: list[str], log_path: Path | None = None) -> None:
        self.lines: list[str] = []
        self.log_path = log_path  # every line also goes here, to read while it runs
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        log = self.log_path.open("a") if self.log_path is not None else None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if log is not None:
                log.write(line)
                log.flush()
        if log is not None:
            log.close()

    def output(self, last: int | None = None) -> str:
        text = "\n".join(self.lines)
        return text if last is None else text[-last:]

    def wait(self, timeout: float = 600) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(5)
        return code
