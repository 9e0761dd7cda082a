"""A session where the session server keeps it: one Redis hash per session, `rlfleet:<run>:session:<id>`
(rlfleet.session.store), written only by the session server and read by it and, read-only, by the
verifier. The id rule, the key and the owner check are written here once, so that both readers see
the same sessions."""

from __future__ import annotations

import re

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from rlfleet.api.session.v1 import session_pb2
from rlfleet.common import security
from rlfleet.common.redis_store import key, text

SESSION_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
SESSION_ID_RULE = "1-128 characters of letters, digits and _.:-"


def session_key(run_id: str, session_id: str) -> str:
    return key(run_id, "session", session_id)


def visible(owner: bytes | str | None, run_id: str) -> bool:
    """Whether the caller may see a session of `owner`: its own (in this run), or any for a service or
    the operator. Another caller's session is answered as not found."""
    return security.caller().may_own(text(owner or b""), run_id)


async def read_session(redis: aioredis.Redis, run_id: str, session_id: str) -> session_pb2.Session | None:
    """The session's token state (what GetSession answers), without the rest of the hash; None when it
    does not exist or the caller may not see it."""
    try:
        raw, owner = await redis.hmget(session_key(run_id, session_id), "session", "owner")
    except ResponseError:  # not a session's hash: an id that names another kind of key ("<id>:turn")
        return None
    if raw is None or not visible(owner, run_id):
        return None
    return session_pb2.Session.FromString(raw)
