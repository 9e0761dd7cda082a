"""Token revocations that reach every host: a Redis set per run, polled by each verifying service.

`rlfleet token revoke` appends the token's id to `<secrets>/revoked` (what processes sharing the run
directory read) and adds it to `rlfleet:<run>:revoked_tokens` in the run's Redis. Every service that
verifies tokens and has Redis (session server, sandbox manager, verifier, gateway, broker) reads that
set every `POLL_S` into its token book, so a compose container or a Kubernetes pod, which has its own
copy of the secrets and no shared volume, refuses a revoked token within about a second as well.

Only the operator's Redis user may add to the set; the services may only read it. A Redis that cannot
be read keeps the last set known: a revocation is never forgotten by an outage, though one made during
it reaches a service only once Redis answers again.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from rlfleet.common.redis_store import key, text
from rlfleet.common.security import TokenBook

PART = "revoked_tokens"
POLL_S = 1.0
log = logging.getLogger("rlfleet.revocations")


def revoked_key(run_id: str) -> str:
    return key(run_id, PART)


async def revoke(client: aioredis.Redis, run_id: str, token_id: str) -> None:
    await client.sadd(revoked_key(run_id), token_id)


async def revoked(client: aioredis.Redis, run_id: str) -> frozenset[str]:
    return frozenset(text(member) for member in await client.smembers(revoked_key(run_id)))


async def watch(client: aioredis.Redis, run_id: str, book: TokenBook, interval_s: float = POLL_S) -> None:
    """Keeps `book.remote_revoked` at the run's revoked set until cancelled."""
    failing = False
    while True:
        try:
            book.remote_revoked = await revoked(client, run_id)
            if failing:
                log.info("revocations: Redis answers again")
            failing = False
        except (RedisError, OSError) as exc:
            if not failing:  # once per outage, not once a second
                log.warning("revocations: cannot read %s (%s); keeping the %d known",
                            revoked_key(run_id), exc, len(book.remote_revoked))
            failing = True
        await asyncio.sleep(interval_s)


def publish_ids(url: str, login: dict[str, str], run_id: str, token_ids: list[str],
                timeout_s: float = 3.0) -> None:
    """Adds `token_ids` to the run's revoked set, from a command-line tool (synchronous redis-py,
    TLS as connect_redis speaks it); `login` is a RedisConfig's user and password or password file."""
    import redis

    from rlfleet.common.infra_auth import read_password
    from rlfleet.common.redis_store import tls_options

    password = read_password(login.get("password", ""), login.get("password_file", ""), "Redis")
    client = redis.Redis.from_url(url, username=login.get("user") or None, password=password or None,
                                  socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                  **tls_options(url))
    try:
        if token_ids:
            client.sadd(revoked_key(run_id), *token_ids)
    finally:
        client.close()
