"""NATS JetStream: the durable streams the loop runs on, with subjects namespaced by run.

| stream        | subject                      | retention  | what                                |
| ------------- | ---------------------------- | ---------- | ----------------------------------- |
| TASKS         | rlfleet.<run>.tasks          | work queue | tasks for rollout workers           |
| TRAJECTORIES  | rlfleet.<run>.trajectories   | limits     | every finished episode (audit log)  |
| POLICY        | rlfleet.<run>.policy         | limits     | policy version announcements        |

Messages are serialized protobufs with a `Rlfleet-Schema` header and, where the record has an
idempotency key, `Nats-Msg-Id` so that JetStream drops a retried publish inside its duplicate
window. Consumers are durable with explicit acks; they must still be idempotent on the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import nats
from nats.errors import AuthorizationError
from nats.errors import Error as NatsError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.client import JetStreamContext
from nats.js.errors import BadRequestError, NotFoundError

from rlfleet.common.config import NatsConfig, require
from rlfleet.common.errors import InvalidArgument, StartupError
from rlfleet.common.infra_auth import inbox_prefix, read_password, without_password

SCHEMA_HEADER = "Rlfleet-Schema"
SCHEMA_VERSION = "1"
TYPE_HEADER = "Rlfleet-Type"
MSG_ID_HEADER = "Nats-Msg-Id"
# Idle heartbeat of the ordered push consumers that follow a stream. nats-py recreates one that
# missed two heartbeats; at its 5 s default a consumer that a NATS restart dropped stayed silent
# for 10-20 s, which starved the run's task feed (the chaos run's stall after the NATS kill).
ORDERED_HEARTBEAT_S = 1.0


@dataclass(frozen=True)
class StreamSpec:
    name: str
    suffix: str
    retention: RetentionPolicy
    max_age_s: float  # 0 = keep forever
    max_msg_bytes: int = 8 << 20


STREAMS = {
    "TASKS": StreamSpec("TASKS", "tasks", RetentionPolicy.WORK_QUEUE, 0),
    "TRAJECTORIES": StreamSpec("TRAJECTORIES", "trajectories", RetentionPolicy.LIMITS, 7 * 24 * 3600),
    "POLICY": StreamSpec("POLICY", "policy", RetentionPolicy.LIMITS, 0),
}


def subject(stream: str, run_id: str) -> str:
    return f"rlfleet.{run_id}.{STREAMS[stream].suffix}"


async def connect_nats(config: NatsConfig, name: str) -> nats.NATS:
    """Connects once with a deadline (a one-line error if nobody answers or the login is refused),
    then reconnects forever."""
    url = require(config.url, "nats.url")
    shown = without_password(url)
    log = logging.getLogger("rlfleet.nats")
    errors: list[Exception] = []
    refused = asyncio.Event()

    async def on_error(exc: Exception) -> None:
        errors.append(exc)
        log.warning("nats: %s", exc or type(exc).__name__)
        if _refused_login(exc):
            refused.set()

    await _probe(url, config.connect_timeout_s)
    # nats-py retries a first connect forever too, a refused login included: it is given up at the
    # first refusal (waiting does not fix a password), or after the deadline.
    connecting = asyncio.ensure_future(nats.connect(
        url, name=name, connect_timeout=config.connect_timeout_s, max_reconnect_attempts=-1,
        reconnect_time_wait=0.5, error_cb=on_error, **_credentials(config, url), **_tls(config, url)))
    refusal = asyncio.ensure_future(refused.wait())
    failure: Exception = TimeoutError()  # neither connected nor failed by the deadline
    try:
        await asyncio.wait({connecting, refusal}, timeout=2 * config.connect_timeout_s + 1,
                           return_when=asyncio.FIRST_COMPLETED)
        if connecting.done():
            return connecting.result()  # or its error
    except (NatsError, OSError) as exc:
        failure = exc
    finally:
        refusal.cancel()
        if not connecting.done():
            connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError, NatsError, OSError):
                await connecting
    # What the reset after it hides.
    why = ([e for e in errors if _refused_login(e)] or errors or [failure])[-1]
    raise StartupError(f"cannot connect to NATS at {shown}: {why or type(why).__name__}")


def _refused_login(exc: Exception) -> bool:
    """nats-py reports a refused login as AuthorizationError or, on some paths, as a plain Error
    carrying the server's "-ERR 'Authorization Violation'" text."""
    return isinstance(exc, AuthorizationError) or "authorization" in str(exc).lower()


def _credentials(config: NatsConfig, url: str) -> dict[str, str]:
    """User and password from config (a password file wins over nothing); a URL with a user in it
    (nats://user:pass@host) is left to speak for itself. Replies come on the user's own inbox,
    which its subscribe permission allows and no other user's does."""
    user = config.user or urlparse(url).username or ""
    options = {"inbox_prefix": inbox_prefix(user)} if user else {}
    if config.user:
        options |= {"user": config.user,
                    "password": read_password(config.password, config.password_file, "NATS")}
    return options


def _tls(config: NatsConfig, url: str) -> dict[str, Any]:
    """A tls:// URL is checked against the run's CA; this process's certificate goes with it where it
    has one. nats:// stays plaintext (a server that demands TLS then refuses the connection)."""
    if urlparse(url).scheme != "tls":
        return {}
    from rlfleet.common.security import client_ssl_context

    return {"tls": client_ssl_context(config.ca_file)}


async def _probe(url: str, timeout_s: float) -> None:
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 4222
    try:
        _reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (TimeoutError, OSError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "timed out"
        raise StartupError(f"cannot reach NATS at {without_password(url)}: {why}") from None
    writer.close()


async def ensure_streams(js: JetStreamContext, names: tuple[str, ...] = tuple(STREAMS)) -> None:
    """Creates the streams, or updates them to this config; safe to call from every process.

    A stream that already has this config is left alone: only a stream's publisher may update it
    (rlfleet.common.infra_auth), and every process calls this at start."""
    for name in names:
        spec = STREAMS[name]
        config = StreamConfig(
            name=spec.name, subjects=[f"rlfleet.*.{spec.suffix}"], retention=spec.retention,
            storage=StorageType.FILE, max_age=spec.max_age_s or None, max_msg_size=spec.max_msg_bytes,
            duplicate_window=120.0)
        try:
            current = (await js.stream_info(spec.name)).config
        except NotFoundError:
            current = None
        if current is not None and _same_stream(current, config):
            continue
        try:
            await js.add_stream(config)
        except BadRequestError:
            await js.update_stream(config)


def _same_stream(current: StreamConfig, wanted: StreamConfig) -> bool:
    fields = ("subjects", "retention", "storage", "max_msg_size", "duplicate_window")
    same_age = (current.max_age or 0) == (wanted.max_age or 0)
    return same_age and all(getattr(current, f) == getattr(wanted, f) for f in fields) and not current.sources


async def ensure_consumer(js: JetStreamContext, stream: str, durable: str, run_id: str, *,
                          ack_wait_s: float = 60.0, max_deliver: int = -1, max_ack_pending: int = 1024,
                          deliver_all: bool = True) -> None:
    """A durable pull consumer on the run's subject; idempotent."""
    config = ConsumerConfig(
        durable_name=durable, ack_policy=AckPolicy.EXPLICIT, filter_subject=subject(stream, run_id),
        ack_wait=ack_wait_s, max_deliver=max_deliver, max_ack_pending=max_ack_pending,
        deliver_policy=DeliverPolicy.ALL if deliver_all else DeliverPolicy.NEW)
    try:
        await js.consumer_info(stream, durable)
    except NotFoundError:
        await js.add_consumer(stream, config)


def durable_name(kind: str, run_id: str) -> str:
    return f"{kind}-{run_id}"


async def publish(js: JetStreamContext, stream: str, run_id: str, payload: bytes, *, msg_type: str,
                  msg_id: str = "", timeout_s: float = 5.0) -> bool:
    """Publishes one record; returns False when JetStream reports it as a duplicate."""
    limit = STREAMS[stream].max_msg_bytes
    if len(payload) > limit:

        raise InvalidArgument(f"{msg_type} of {len(payload)} bytes exceeds "
                              f"the {stream} limit of {limit} bytes")
    headers = {SCHEMA_HEADER: SCHEMA_VERSION, TYPE_HEADER: msg_type}
    if msg_id:
        headers[MSG_ID_HEADER] = msg_id
    ack = await js.publish(subject(stream, run_id), payload, headers=headers, timeout=timeout_s)
    return not ack.duplicate
