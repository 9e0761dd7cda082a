"""Redis: hot shared state (sessions, leases, engine registry, verdicts), namespaced by run."""

from __future__ import annotations

import functools
import ssl
import threading
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlparse

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.driver_info import DriverInfo
from redis.exceptions import AuthenticationError, AuthorizationError, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rlfleet.common.config import RedisConfig, require
from rlfleet.common.errors import StartupError
from rlfleet.common.infra_auth import read_password, without_password


async def connect_redis(config: RedisConfig) -> aioredis.Redis:
    """Connects and pings, so an unreachable Redis is a one-line start-up error, not a later hang."""
    url = require(config.url, "redis.url")
    # A Redis that restarted (the launcher's supervision, a pod rescheduled) closes every pooled
    # connection: each command retries on a new one with backoff bounded to 2 s, for ~10 s in all,
    # rather than fail once per stale connection.
    retry = RetryNotRefusals(ExponentialBackoff(cap=2.0, base=0.1), retries=8)
    # User and password from config; a URL with them in it (redis://user:pass@host) wins.
    login: dict[str, Any] = {"username": config.user,
                             "password": read_password(config.password, config.password_file, "Redis")} \
        if config.user else {}
    client = aioredis.Redis.from_url(url, **login, socket_connect_timeout=config.connect_timeout_s,
                                     socket_timeout=max(config.connect_timeout_s, 10.0),
                                     decode_responses=False,
                                     retry=retry, retry_on_error=[RedisConnectionError, RedisTimeoutError],
                                     **tls_options(url))
    pool = client.connection_pool
    # What every new pooled connection announces (CLIENT SETINFO): made once. Left to redis-py, each
    # connection of a growing pool looks the version up with importlib.metadata, a scan of sys.path.
    pool.connection_kwargs["driver_info"] = _driver_info()
    if urlparse(url).scheme == "rediss":
        pool.connection_class = SharedContextSSLConnection
        pool.connection_kwargs["shared_context"] = _shared_context(pool.connection_kwargs)
    try:
        await client.ping()
    except (RedisError, OSError) as exc:
        await client.aclose()
        raise StartupError(f"cannot reach Redis at {without_password(url)}: {exc}") from None
    return client


class RetryNotRefusals(Retry):
    """Retries a lost connection, never a refused login: redis-py's AuthenticationError and
    AuthorizationError are ConnectionErrors, and waiting does not fix a wrong password (retried, a
    start-up with one took ~10 s to say so)."""

    async def call_with_retry(self, do: Any, fail: Any, is_retryable: Any = None,
                              with_failure_count: bool = False) -> Any:
        def retryable(error: Exception) -> bool:
            if isinstance(error, (AuthenticationError, AuthorizationError)):
                return False
            return is_retryable is None or is_retryable(error)

        return await super().call_with_retry(do, fail, retryable, with_failure_count)


def tls_options(url: str) -> dict[str, Any]:
    """redis-py's TLS arguments for a rediss:// URL: the run's CA to check the server by and this
    process's certificate (the platform's Redis demands one: mutual TLS); {} for redis://."""
    if urlparse(url).scheme != "rediss":
        return {}
    from rlfleet.common.security import local_credentials

    creds = local_credentials()
    if not creds.cert_file:
        raise StartupError("Redis over TLS needs a service's certificate (RLFLEET_SECRETS_DIR); "
                           "an environment client has none and never talks to Redis")
    return {"ssl_ca_data": creds.ca.decode(), "ssl_certfile": creds.cert_file, "ssl_cert_reqs": "required"}


class SharedContextSSLConnection(aioredis.SSLConnection):
    """redis-py's TLS connection, on one SSL context per process rather than one per connection.

    redis-py builds a fresh context for every new pooled connection: `ssl.create_default_context()`
    (which loads the system CA bundle), then our CA and certificate. A pool grows whenever more
    commands are in flight than it has connections (32 concurrent turns), and each new connection
    then blocked the event loop for tens of ms: the secure service path's p99 was ~0.6 s against
    ~45 ms in plaintext. The shared context checks the same things (server certificate against the
    run's CA, host name, our certificate presented), and trusts only the run's CA, not the system's."""

    def __init__(self, *, shared_context: ssl.SSLContext, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ssl_context.context = shared_context  # RedisSSLContext.get() returns it as built


@functools.cache
def _driver_info() -> DriverInfo:
    return DriverInfo()


_contexts: dict[tuple[str, str], ssl.SSLContext] = {}
_contexts_lock = threading.Lock()


def _shared_context(options: Mapping[str, Any]) -> ssl.SSLContext:
    ca, cert_file = options["ssl_ca_data"], options["ssl_certfile"]
    with _contexts_lock:
        context = _contexts.get((ca, cert_file))
        if context is None:
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=ca)
            context.load_cert_chain(cert_file)
            _contexts[(ca, cert_file)] = context
        return context


def text(raw: bytes | str) -> str:
    """A key or value read back as text. connect_redis never decodes, so it is bytes, though redis-py
    types every reply bytes | str."""
    return raw.decode() if isinstance(raw, bytes) else raw


def members(reply: Iterable[object]) -> list[str]:
    """The members of a sorted-set range read without scores (ZRANGE and friends), as text;
    redis-py types the reply as members or (member, score) pairs either way."""
    found = []
    for member in reply:
        if not isinstance(member, bytes | str):
            raise TypeError(f"members() reads a range without scores, got {member!r}")
        found.append(text(member))
    return found


def binary_hash(raw: Mapping[bytes | str, bytes | str]) -> dict[bytes, bytes]:
    """A hash read back (HGETALL) as the bytes -> bytes it is from connect_redis's client, which
    redis-py types bytes | str."""
    return {_binary(k): _binary(v) for k, v in raw.items()}


def _binary(raw: bytes | str) -> bytes:
    return raw if isinstance(raw, bytes) else raw.encode()


def key(run_id: str, *parts: str) -> str:
    """`rlfleet:<run>:<part>:...` so that runs sharing one Redis never see each other's keys."""
    return ":".join(("rlfleet", run_id, *parts))
