"""Session state in Redis, so that any replica serves any session and a restart loses nothing.

Redis layout (namespaced by run):

    rlfleet:<run>:session:<session_id>   HASH  session (Session proto), sampling (SamplingParams proto),
                                               info (JSON: timings, counters), rev, trajectory
                                               (Trajectory proto, once closing), published, released
                                               (set by the sealing commit, which gives back the
                                               session's admission slot and affinity itself)
    rlfleet:<run>:sessions:open          ZSET  session_id -> last change (unix s): the open-session limit
    rlfleet:<run>:session:<session_id>:turn  STRING  the token of the Generate running on the session
                                               (SET NX, a 10 s lease renewed while the turn runs)

Every change is a compare-and-set on `rev`: a call reads the session, does its work (e.g. a whole
engine round trip) and writes back only if nobody changed the session meanwhile. A concurrent second
call on one session loses. The one lease is a Generate's turn: a second Generate on a busy session
is refused before it costs an engine generation. The lease is short and renewed while the turn runs,
so a server killed mid-turn leaves the session busy for at most one lease (10 s).
Keys expire `session_ttl_s` after their last change.
"""

from __future__ import annotations

import time
import uuid

import redis.asyncio as aioredis

from rlfleet.api.session.v1 import session_pb2
from rlfleet.common import security, session_slots
from rlfleet.common.adapter_routes import routes_key as adapter_routes_key
from rlfleet.common.redis_store import binary_hash, key, members
from rlfleet.common.session_slots import ADMIT_LUA
from rlfleet.common.stored_sessions import read_session, session_key, visible
from rlfleet.session.errors import ConcurrentSessionCall, SessionNotFound, SessionsExhausted
from rlfleet.session.state import SessionState

# KEYS: session hash, open zset, turn lease[, admission inflight, counts]. ARGV: session_id, now, stale
# cutoff, max open, ttl, lease token ("" = none), lease ms, now ms, the admission policy, the
# gateway's advert and the adapter routes keys ("" = no admission here), field/value pairs... With
# a token the new session starts with its first turn's lease taken (an OpenSession that generates
# the first turn too). With the admission keys the session is admitted here, by the gateway's own
# rules (rlfleet.common.session_slots) on what the gateway advertises, instead of by an Admit round
# trip to the gateway: 'stale:<retry ms>' or 'inflight_limit:<retry ms>' when refused, 'no_advert'
# when no gateway advertised yet. The three keys this server may only read go as ARGV: a script's
# declared KEYS count as written (Redis 7 ACLs), so a read-only key cannot be one.
_CREATE = ADMIT_LUA + """
if redis.call('EXISTS', KEYS[1]) == 1 then return 'exists' end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[3])
if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[4]) then return 'full' end
if ARGV[9] ~= '' then
  local advert = redis.call('HMGET', ARGV[10], 'engines_min_version', 'role', 'lease_ms', 'retry_after_ms')
  if not advert[3] then return 'no_advert' end
  local now_ms = tonumber(ARGV[8])
  local outcome = admit(KEYS[4], KEYS[5], ARGV[9], ARGV[11], ARGV[1], now_ms, now_ms - tonumber(advert[3]),
                        tonumber(advert[1]), advert[2])
  if outcome ~= 'admitted' then return outcome .. ':' .. advert[4] end
end
redis.call('HSET', KEYS[1], 'rev', 1, unpack(ARGV, 12))
redis.call('EXPIRE', KEYS[1], ARGV[5])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
if ARGV[6] ~= '' then redis.call('SET', KEYS[3], ARGV[6], 'PX', ARGV[7]) end
return 'created'
"""

# KEYS: session hash, open zset, turn lease[, admission inflight zset, affinity]. ARGV: expected rev,
# ttl, session_id, now, still open (1/0), lease token ("" = none), engine_sessions key prefix ("" =
# no release), field/value pairs... With a lease, a commit that lands ends the turn too (the lease
# is dropped if it is still this token's): one round trip, not two. With the gateway's keys
# (rlfleet.common.session_slots), the commit that seals the session also gives back its admission
# slot and engine affinity, as the gateway's Release would: no round trip to the gateway.
_COMMIT = """
local rev = redis.call('HGET', KEYS[1], 'rev')
if not rev then return -1 end
if rev ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 8))
if ARGV[7] ~= '' then
  redis.call('ZREM', KEYS[4], ARGV[3])
  local engine = redis.call('GETDEL', KEYS[5])
  if engine then redis.call('ZREM', ARGV[7] .. engine, ARGV[3]) end
  redis.call('HSET', KEYS[1], 'released', '1')
end
redis.call('HINCRBY', KEYS[1], 'rev', 1)
redis.call('EXPIRE', KEYS[1], ARGV[2])
if ARGV[5] == '1' then
  redis.call('ZADD', KEYS[2], 'XX', ARGV[4], ARGV[3])
else
  redis.call('ZREM', KEYS[2], ARGV[3])
end
if ARGV[6] ~= '' and redis.call('GET', KEYS[3]) == ARGV[6] then redis.call('DEL', KEYS[3]) end
return 1
"""

# KEYS: session hash, turn lease. ARGV: token, lease ms, the owner the caller may see ("*": any).
# Takes the turn lease and reads the session under it, in one round trip; a session the caller may
# not see is answered as missing before any lease is taken (no one can hold another's session busy).
_BEGIN_TURN = """
local owner = redis.call('HGET', KEYS[1], 'owner')
if not owner then
  if redis.call('EXISTS', KEYS[1]) == 0 then return 'missing' end
  owner = ''
end
if ARGV[3] ~= '*' and owner ~= ARGV[3] then return 'missing' end
if not redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return 'busy' end
return redis.call('HGETALL', KEYS[1])
"""


# KEYS: lease key. ARGV: token.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: lease key. ARGV: token, ttl ms.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


class SessionStore:
    def __init__(self, redis: aioredis.Redis, run_id: str, ttl_s: float, max_open: int) -> None:
        self.redis = redis
        self.run_id = run_id
        self.ttl_s = int(max(1, ttl_s))
        self.max_open = max_open
        self._open_key = key(run_id, "sessions", "open")
        self._create = redis.register_script(_CREATE)
        self._commit = redis.register_script(_COMMIT)
        self._release = redis.register_script(_RELEASE)
        self._renew = redis.register_script(_RENEW)
        self._begin_turn = redis.register_script(_BEGIN_TURN)

    def _key(self, session_id: str) -> str:
        return session_key(self.run_id, session_id)

    def visible(self, owner: bytes | str | None) -> bool:
        return visible(owner, self.run_id)

    async def load(self, session_id: str) -> SessionState:
        raw = binary_hash(await self.redis.hgetall(self._key(session_id)))
        if not raw or not self.visible(raw.get(b"owner")):
            raise SessionNotFound(session_id)
        return SessionState.from_fields(raw)

    async def load_with(self, session_id: str, other_key: str) -> tuple[SessionState, bytes | None]:
        """The session and the value of another (string) key, read in one round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self._key(session_id))
            pipe.get(other_key)
            raw, other = await pipe.execute()
        if not raw or not self.visible(raw.get(b"owner")):
            raise SessionNotFound(session_id)
        return SessionState.from_fields(raw), other

    async def load_session(self, session_id: str) -> session_pb2.Session:
        """Only the token state (what GetSession answers), without the rest of the hash."""
        session = await read_session(self.redis, self.run_id, session_id)
        if session is None:
            raise SessionNotFound(session_id)
        return session

    async def find(self, session_id: str) -> SessionState | None:
        raw = binary_hash(await self.redis.hgetall(self._key(session_id)))
        return SessionState.from_fields(raw) if raw else None

    async def create(self, state: SessionState, turn_token: str = "", lease_s: float = 0.0,
                     admit: bool = False) -> str:
        """Stores a new open session: 'created', 'exists' (one with this id exists already: a retried
        open), or with `admit` 'no_advert' (no gateway advertised admission yet: admit through it).
        `turn_token`: the new session's turn lease is taken under it (for `lease_s`). `admit`: the
        session is admitted in the same script; SessionsExhausted with the gateway's reason if not."""
        now = time.time()
        run = self.run_id
        readable = ([session_slots.policy_key(run), session_slots.fleet_key(run), adapter_routes_key(run)]
                    if admit else ["", "", ""])
        args = [state.session_id, now, now - self.ttl_s, self.max_open, self.ttl_s, turn_token,
                int(lease_s * 1000), int(now * 1000), *readable, *_pairs(state.fields())]
        keys = [self._key(state.session_id), self._open_key, self._key(state.session_id) + ":turn"]
        if admit:
            keys += [session_slots.inflight_key(run), session_slots.counts_key(run)]
        outcome = (await self._create(keys=keys, args=args)).decode()
        if outcome == "full":
            raise SessionsExhausted(f"{self.max_open} sessions are open on this run (max_open_sessions); "
                                    "close some or retry later", reason="max_open_sessions")
        reason, _, retry_ms = outcome.partition(":")
        if retry_ms:  # refused by admission: as the gateway's Admit says it
            raise SessionsExhausted(f"the gateway refused a new session: {reason} "
                                    f"(retry after {retry_ms} ms)",
                                    reason=reason, retry_after_s=int(retry_ms) / 1000)
        if outcome == "created":
            state.rev = 1
        return outcome

    async def commit(self, state: SessionState, end_turn: str = "", release: bool = False) -> None:
        """Writes the state if nobody changed it since it was loaded; raises ConcurrentSessionCall otherwise.
        `end_turn`: the token of the turn lease this commit ends (dropped with it when it lands).
        `release`: give back the session's admission slot and engine affinity with it (the sealing commit)."""
        still_open = "1" if not state.trajectory else "0"
        session_id = state.session_id
        # The sampling defaults never change after create, so a commit does not rewrite them.
        args = [state.rev, self.ttl_s, session_id, time.time(), still_open, end_turn,
                session_slots.engine_sessions_key(self.run_id, "") if release else "",
                *_pairs(state.fields(with_sampling=False))]
        keys = [self._key(session_id), self._open_key, self._key(session_id) + ":turn"]
        if release:
            keys += [session_slots.inflight_key(self.run_id),
                     session_slots.affinity_key(self.run_id, session_id)]
        result = await self._commit(keys=keys, args=args)
        if result == -1:
            raise SessionNotFound(state.session_id)
        if result == 0:
            raise ConcurrentSessionCall(
                f"session {state.session_id!r} was changed by another call while this one ran; this call's "
                "change was discarded (calls on one session must not overlap)", session_id=state.session_id)
        state.rev += 1
        state.released = state.released or release

    async def begin_turn_and_load(self, session_id: str, lease_s: float) -> tuple[SessionState, str | None]:
        """Takes the session's turn lease and loads the session under it (one round trip): the state
        and the lease's token, or None when another Generate holds it. NOT_FOUND for a session the
        caller may not see, as `load`."""
        principal = security.caller()
        if not (principal.trusted or principal.may_use_run(self.run_id)):  # as `visible`
            raise SessionNotFound(session_id)
        token = uuid.uuid4().hex
        visible_owner = "*" if principal.trusted else principal.owner
        reply = await self._begin_turn(keys=[self._key(session_id), self._key(session_id) + ":turn"],
                                       args=[token, int(lease_s * 1000), visible_owner])
        if reply == b"missing":
            raise SessionNotFound(session_id)
        if reply == b"busy":
            return await self.load(session_id), None
        return SessionState.from_fields(dict(zip(reply[::2], reply[1::2], strict=True))), token

    async def begin_turn(self, session_id: str, lease_s: float) -> str | None:
        """Takes the session's turn lease; its token, or None when another Generate holds it."""
        token = uuid.uuid4().hex
        taken = await self.redis.set(self._key(session_id) + ":turn", token, nx=True, px=int(lease_s * 1000))
        return token if taken else None

    async def renew_turn(self, session_id: str, token: str, lease_s: float) -> bool:
        return bool(await self._renew(keys=[self._key(session_id) + ":turn"],
                                      args=[token, int(lease_s * 1000)]))

    async def end_turn(self, session_id: str, token: str) -> None:
        await self._release(keys=[self._key(session_id) + ":turn"], args=[token])

    async def mark(self, session_id: str, *flags: str) -> None:
        """Records close steps that need no compare-and-set (published, released): they only ever
        go 0 -> 1."""
        await self.redis.hset(self._key(session_id), mapping=dict.fromkeys(flags, "1"))

    async def idle_sessions(self, idle_s: float, limit: int = 256) -> list[str]:
        """Open sessions whose last change is more than `idle_s` ago."""
        ids = await self.redis.zrangebyscore(self._open_key, "-inf", time.time() - idle_s, start=0, num=limit)
        return members(ids)

    async def last_change(self, session_id: str) -> float | None:
        return await self.redis.zscore(self._open_key, session_id)

    async def open_count(self) -> int:
        return await self.redis.zcount(self._open_key, time.time() - self.ttl_s, "+inf")


def _pairs(fields: dict[str, bytes]) -> list[str | bytes]:
    return [item for name, value in fields.items() for item in (name, value)]
