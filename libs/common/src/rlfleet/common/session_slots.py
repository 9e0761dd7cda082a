"""What a session holds at the gateway until it ends, where the gateway keeps it in Redis: its
admission slot and its engine affinity (rlfleet.gateway.admission, rlfleet.gateway.router).

The gateway routes; admission is decided by one Lua function (`ADMIT_LUA`), run by the gateway's
Admit and, without a round trip to the gateway, by the script that creates a session
(rlfleet.session.store), with what the gateway advertises in `admission:fleet`: the version its
engines serve new sessions at, the adapter role of those sessions, the slot lease and the retry
hint. The session server gives the slot and the affinity back in the script that seals the session,
instead of a Release round trip after every close. Both sides build the keys here, so the layout
is written down once.

    rlfleet:<run>:admission:inflight             ZSET   session_id -> admitted at (unix ms)
    rlfleet:<run>:admission:counts               HASH   admitted, refused:<reason>
    rlfleet:<run>:admission:policy               HASH   max_inflight_sessions, trainer_version, max_staleness
    rlfleet:<run>:admission:fleet                HASH   engines_min_version ("" = unknown), role,
                                                        lease_ms, retry_after_ms (the gateway's)
    rlfleet:<run>:affinity:<session_id>          STRING engine_id
    rlfleet:<run>:engine_sessions:<engine_id>    ZSET   session_id -> last turn (unix s)
"""

from __future__ import annotations

from rlfleet.common.redis_store import key

# The admission rules, one function for both scripts that admit. Arguments: the inflight, counts
# and policy keys, the adapter routes hash (false: none), the session, now and the lease cutoff
# (unix ms), the engines' oldest version (nil: unknown) and the sessions' adapter role. A role
# served by an adapter (rlfleet.common.adapter_routes: canary falls back to fleet's) is at that
# adapter's version. Returns 'admitted', 'stale' or 'inflight_limit'.
ADMIT_LUA = """
local function admit(inflight, counts, policy_key, routes, sid, now, cutoff, fleet, role)
  redis.call('ZREMRANGEBYSCORE', inflight, '-inf', cutoff)
  if redis.call('ZSCORE', inflight, sid) then
    redis.call('ZADD', inflight, now, sid)
    return 'admitted'
  end
  local policy = redis.call('HMGET', policy_key, 'max_inflight_sessions', 'trainer_version', 'max_staleness')
  local max_inflight = tonumber(policy[1]) or 0
  local trainer = tonumber(policy[2]) or 0
  local staleness = tonumber(policy[3]) or -1
  if routes then
    local route = redis.call('HGET', routes, role)
    if not route and role == 'canary' then route = redis.call('HGET', routes, 'fleet') end
    if route then fleet = tonumber(cjson.decode(route)['version']) end
  end
  if staleness >= 0 and fleet ~= nil and fleet < trainer - staleness then
    redis.call('HINCRBY', counts, 'refused:stale', 1)
    return 'stale'
  end
  if max_inflight > 0 and redis.call('ZCARD', inflight) >= max_inflight then
    redis.call('HINCRBY', counts, 'refused:inflight_limit', 1)
    return 'inflight_limit'
  end
  redis.call('ZADD', inflight, now, sid)
  redis.call('HINCRBY', counts, 'admitted', 1)
  return 'admitted'
end
"""


def inflight_key(run_id: str) -> str:
    return key(run_id, "admission", "inflight")


def counts_key(run_id: str) -> str:
    return key(run_id, "admission", "counts")


def policy_key(run_id: str) -> str:
    return key(run_id, "admission", "policy")


def fleet_key(run_id: str) -> str:
    """What the gateway advertises for admission decided elsewhere (the session server's create)."""
    return key(run_id, "admission", "fleet")


def affinity_key(run_id: str, session_id: str) -> str:
    return key(run_id, "affinity", session_id)


def engine_sessions_key(run_id: str, engine_id: str) -> str:
    """With engine_id "": the prefix an engine's id completes (a script that learns the engine from
    the affinity builds the key from it)."""
    return key(run_id, "engine_sessions", engine_id)
