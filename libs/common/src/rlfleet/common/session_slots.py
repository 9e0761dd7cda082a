"""What a session holds at the gateway until it ends, where the gateway keeps it in Redis: its
admission slot and its engine affinity (rlfleet.gateway.admission, rlfleet.gateway.router).

The gateway admits and routes; the session server gives both back in the Redis script that seals
the session (rlfleet.session.store), instead of a Release round trip to the gateway after every
close. Both sides build the keys here, so the layout is written down once.

    rlfleet:<run>:admission:inflight             ZSET   session_id -> admitted at (unix ms)
    rlfleet:<run>:affinity:<session_id>          STRING engine_id
    rlfleet:<run>:engine_sessions:<engine_id>    ZSET   session_id -> last turn (unix s)
"""

from __future__ import annotations

from rlfleet.common.redis_store import key


def inflight_key(run_id: str) -> str:
    return key(run_id, "admission", "inflight")


def affinity_key(run_id: str, session_id: str) -> str:
    return key(run_id, "affinity", session_id)


def engine_sessions_key(run_id: str, engine_id: str) -> str:
    """With engine_id "": the prefix an engine's id completes (a script that learns the engine from
    the affinity builds the key from it)."""
    return key(run_id, "engine_sessions", engine_id)
