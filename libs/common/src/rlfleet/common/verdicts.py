"""The verdict store: the verifier writes one verdict per session, the session server reads it at close.

Only the verifier service writes here; the environment client never supplies a reward. A verdict is
a serialized `rlfleet.common.v1.Verdict` under `rlfleet:<run>:verdicts:<session_id>`.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from rlfleet.api.common.v1 import common_pb2
from rlfleet.common.redis_store import key

VERDICT_TTL_S = 7 * 24 * 3600


def verdict_key(run_id: str, session_id: str) -> str:
    return key(run_id, "verdicts", session_id)


async def store_verdict(redis: aioredis.Redis, run_id: str, verdict: common_pb2.Verdict) -> None:
    if not verdict.session_id:
        raise ValueError("a stored verdict needs its session_id")
    await redis.set(verdict_key(run_id, verdict.session_id), verdict.SerializeToString(), ex=VERDICT_TTL_S)


async def load_verdict(redis: aioredis.Redis, run_id: str, session_id: str) -> common_pb2.Verdict | None:
    raw = await redis.get(verdict_key(run_id, session_id))
    return None if raw is None else common_pb2.Verdict.FromString(raw)
