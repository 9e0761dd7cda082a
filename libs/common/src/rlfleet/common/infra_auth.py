"""Who may do what on NATS and Redis: one user per service, its password in `<run_dir>/secrets/`.

`rlfleet up` / `rlfleet run` (and the test harness) call `ensure_infra_secrets` on first start: it
writes one random password per NATS and per Redis user, mode 0600, and keeps them on later starts
(a restarted service must still log in). The launcher then starts `nats-server` with
`nats_authorization` (users with per-subject publish/subscribe permissions) and `redis-server` with
`redis_acl` (users with key patterns; `default` off, so a client without a password is refused).

NATS permissions follow the streams in `rlfleet.common.streams` and the worker's task queue:

| user           | publishes                       | consumes (durable or ephemeral) |
| -------------- | ------------------------------- | ------------------------------- |
| session-server | TRAJECTORIES                    | -                               |
| trainer        | POLICY                          | TRAJECTORIES                    |
| weight-broker  | -                               | POLICY                          |
| worker         | TASKS_DEAD (dead letters)       | TASKS (+ its max-deliveries advisories, get/delete
                                                     of a lost task) |
| operator       | TASKS (`rlfleet-submit`) | TRAJECTORIES, POLICY, TASKS_DEAD (watching), stream and
                                              consumer info |
| controller     | TASKS (the run's feed), TASKS_DEAD | the operator's and the worker's: it runs the rollout
                                                        worker in its process |

The run's state (the controller's, rlfleet.controller.state_store) is the JetStream KV bucket
`RLFLEET_RUNS`: only the controller may create it and read or write its run's keys
(`$KV.RLFLEET_RUNS.<run>.>`, reads by direct get on those subjects); nobody else may even read it.

Every user may read stream info and create the platform's streams (each process ensures them at
start, whoever comes first), but only a stream's publisher may update its config: an update could
add a source with a subject transform, which is a way to publish into it. Replies come on a per-user
inbox (`_INBOX_<user>.>`), so one service cannot read the answers another one fetched.

Redis users see only `rlfleet:<run>:<part>:*` for the parts their service owns; dangerous commands
(FLUSHALL, KEYS, CONFIG, DEBUG, ...) and pub/sub are off for all of them.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

SECRETS_DIR = "secrets"

# The platform's streams, their subject suffixes (rlfleet.<run>.<suffix>), who publishes each.
STREAM_SUFFIXES = {"TASKS": "tasks", "TRAJECTORIES": "trajectories", "POLICY": "policy",
                   "TASKS_DEAD": "tasks_dead"}
PLATFORM_STREAMS = ("TASKS", "TRAJECTORIES", "POLICY")  # what every process ensures at start
# JetStream KV: the run's state, keys `<run>.*` (rlfleet.controller.state_store).
RUN_STATE_BUCKET = "RLFLEET_RUNS"

NATS_ROLES: dict[str, dict[str, tuple[str, ...]]] = {
    "session-server": {"publish": ("TRAJECTORIES",), "consume": ()},
    "trainer": {"publish": ("POLICY",), "consume": ("TRAJECTORIES",), "read": ("POLICY",)},
    "weight-broker": {"publish": (), "consume": ("POLICY",)},
    "worker": {"publish": ("TASKS_DEAD",), "consume": ("TASKS",), "read": ("TASKS",), "delete": ("TASKS",),
               "advisories": ("TASKS",)},
    "operator": {"publish": ("TASKS",), "consume": ("TRAJECTORIES", "POLICY", "TASKS_DEAD"),
                 "list": ("TASKS",)},
    # The run's control: the operator's feed and watch, and the rollout worker it runs in its process.
    # It alone keeps the run's state (KV buckets: create, read and write its run's keys).
    "controller": {"publish": ("TASKS", "TASKS_DEAD"),
                   "consume": ("TASKS", "TRAJECTORIES", "POLICY", "TASKS_DEAD"),
                   "read": ("TASKS",), "delete": ("TASKS",), "advisories": ("TASKS",), "list": ("TASKS",),
                   "kv": (RUN_STATE_BUCKET,)},
}

# Redis key parts (rlfleet:<run>:<part>...) each service reads or writes.
REDIS_ROLES: dict[str, tuple[str, ...]] = {
    # verdicts: read at CloseSession; admission slots, counts and engine affinities (the gateway's,
    # rlfleet.common.session_slots): taken by the script that creates a session, given back by the
    # one that seals it.
    "session-server": ("session", "sessions", "verdicts", "admission:inflight", "admission:counts",
                       "affinity", "engine_sessions"),
    "rollout-gateway": ("affinity", "engine_sessions", "admission", "engines", "engine", "adapter_routes"),
    "weight-broker": ("broker", "adapter_routes"),  # adapter routes: the broker writes, the gateway reads
    "sandbox-manager": ("sandbox",),
    "verifier": ("verdicts",),
    # `rlfleet token revoke`: adds to the run's revoked token ids (rlfleet.common.revocations), nothing else.
    "operator": ("revoked_tokens",),
}
# Key parts a service may only read (Redis 7 `%R~`): the verifier reads a session's tokens where the
# session server keeps them, instead of asking the session server for them over gRPC on every
# verdict; only the session server writes them, so they are still what it vouches for.
# The session server admits sessions in its own create script, by the policy the operator sets and
# what the gateway advertises (rlfleet.common.session_slots), and cannot change either.
# Every service that verifies tokens reads the run's revocations (rlfleet.common.revocations).
REDIS_READ_ROLES: dict[str, tuple[str, ...]] = {
    "verifier": ("session", "revoked_tokens"),
    "session-server": ("admission:policy", "admission:fleet", "adapter_routes", "revoked_tokens"),
    "rollout-gateway": ("revoked_tokens",), "weight-broker": ("revoked_tokens",),
    "sandbox-manager": ("revoked_tokens",)}
# Which NATS / Redis user each process logs in as.
NATS_USER_OF = {"session-server": "session-server", "trainer": "trainer", "weight-broker": "weight-broker",
                "worker": "worker", "rlfleet-controller": "controller", "rlfleet-run": "operator",
                "rlfleet-status": "operator", "rlfleet-submit": "operator"}


@dataclass(frozen=True)
class Credential:
    user: str
    password_file: Path

    @property
    def password(self) -> str:
        return self.password_file.read_text().strip()

    def nats(self) -> dict[str, str]:
        """The `nats` config section's credential keys (a password file, never the password itself)."""
        return {"user": self.user, "password_file": str(self.password_file)}

    redis = nats


@dataclass(frozen=True)
class InfraSecrets:
    directory: Path
    nats: dict[str, Credential]
    redis: dict[str, Credential]


def planned_secrets(directory: str | Path) -> InfraSecrets:
    """The users and where their password files are (or will be) in `directory`, writing nothing:
    what a config generated for another machine or a container refers to."""
    root = Path(directory)
    return InfraSecrets(root, {u: Credential(u, root / f"nats-{u}.password") for u in NATS_ROLES},
                        {u: Credential(u, root / f"redis-{u}.password") for u in REDIS_ROLES})


def secrets_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / SECRETS_DIR


def run_dir_login(run_dir: str | Path, kind: str, user: str) -> dict[str, str]:
    """`{"user", "password_file"}` of a NATS or Redis (`kind`) user of a launched platform, for
    tools that attach to it from its run directory; {} when the run directory has no such secret."""
    path = secrets_dir(run_dir) / f"{kind}-{user}.password"
    return {"user": user, "password_file": str(path)} if path.exists() else {}


def write_secret(path: Path, text: str) -> None:
    """Creates `path` with mode 0600 from the start (no window where it is readable by others)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.chmod(path, 0o600)  # an older file with a wider mode is narrowed too


def _credential(directory: Path, kind: str, user: str) -> Credential:
    path = directory / f"{kind}-{user}.password"
    if not path.exists() or not path.read_text().strip():
        write_secret(path, secrets.token_urlsafe(32) + "\n")
    return Credential(user, path)


def ensure_infra_secrets(directory: str | Path, extra_nats: tuple[str, ...] = (),
                         extra_redis: tuple[str, ...] = ()) -> InfraSecrets:
    """One password per NATS user and per Redis user in `directory` (0700), made on first call and
    kept after; `extra_*` adds users beyond the services' (the test harness's superuser)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    nats = {user: _credential(root, "nats", user) for user in (*NATS_ROLES, *extra_nats)}
    redis = {user: _credential(root, "redis", user) for user in (*REDIS_ROLES, *extra_redis)}
    return InfraSecrets(root, nats, redis)


def read_password(password: str, password_file: str, what: str) -> str:
    """The password given inline, else the first line of `password_file` ('' when neither is set)."""
    if password or not password_file:
        return password
    try:
        return Path(password_file).read_text().strip()
    except OSError as exc:
        from rlfleet.common.errors import StartupError

        raise StartupError(f"cannot read {what} password file {password_file}: {exc.strerror}") from None


def without_password(url: str) -> str:
    """A URL fit for a log line: a password in it (scheme://user:password@host) replaced by ***."""
    parsed = urlparse(url)
    if parsed.password is None:
        return url
    return url.replace(f":{parsed.password}@", ":***@", 1)


def inbox_prefix(user: str) -> str:
    """Each user's replies on a subject tree of its own, so permissions can keep them private."""
    return f"_INBOX_{user}"


# -- NATS ----------------------------------------------------------------------------------------


def _subject(stream: str, run: str) -> str:
    return f"rlfleet.{run}.{STREAM_SUFFIXES[stream]}"


def _consumer_api(stream: str) -> list[str]:
    """What a client needs to create, bind, fetch from and settle on a consumer of `stream`."""
    return [f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.>",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.>", f"$JS.API.CONSUMER.INFO.{stream}.>",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.>", f"$JS.API.CONSUMER.DELETE.{stream}.>",
            f"$JS.ACK.{stream}.>", f"$JS.FC.{stream}.>"]


def nats_permissions(role: str, run: str = "*") -> dict[str, dict[str, list[str]]]:
    """The publish/subscribe allow-lists of one service user; `run` narrows subjects to one run."""
    spec = NATS_ROLES[role]
    publish = ["$JS.API.INFO", "$JS.API.STREAM.INFO.*", "$JS.API.STREAM.NAMES", "$JS.API.STREAM.LIST",
               *(f"$JS.API.STREAM.CREATE.{s}" for s in PLATFORM_STREAMS)]
    for stream in spec["publish"]:
        publish += [_subject(stream, run), f"$JS.API.STREAM.CREATE.{stream}",
                    f"$JS.API.STREAM.UPDATE.{stream}"]
    for stream in spec["consume"]:
        publish += _consumer_api(stream)
    for stream in spec.get("read", ()):
        publish += [f"$JS.API.STREAM.MSG.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}",
                    f"$JS.API.DIRECT.GET.{stream}.>"]
    for stream in spec.get("delete", ()):
        publish.append(f"$JS.API.STREAM.MSG.DELETE.{stream}")
    for stream in (*spec["consume"], *spec.get("list", ())):
        publish += [f"$JS.API.CONSUMER.LIST.{stream}", f"$JS.API.CONSUMER.NAMES.{stream}",
                    f"$JS.API.CONSUMER.INFO.{stream}.>"]
    for bucket in spec.get("kv", ()):
        publish += kv_permissions(bucket, run)
    subscribe = [f"{inbox_prefix(role)}.>"]
    subscribe += [f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{s}.>" for s in spec.get("advisories", ())]
    return {"publish": {"allow": sorted(set(publish))}, "subscribe": {"allow": subscribe}}


def kv_permissions(bucket: str, run: str = "*") -> list[str]:
    """Create a KV bucket, and put, update (a revision check rides on the publish), purge and read
    (direct get) the keys of `run` in it: `<run>.<anything>`."""
    keys = f"$KV.{bucket}.{run}.>"
    return [f"$JS.API.STREAM.CREATE.KV_{bucket}", keys, f"$JS.API.DIRECT.GET.KV_{bucket}.{keys}"]


def nats_authorization(infra: InfraSecrets, run: str = "*", superusers: tuple[str, ...] = ()) -> str:
    """The `authorization { users = [...] }` block of nats-server's config (JSON is valid NATS
    config syntax). `superusers` may do anything: only the test harness has one."""
    users: list[dict[str, Any]] = []
    for user, credential in infra.nats.items():
        if user in superusers:
            users.append({"user": user, "password": credential.password})
        elif user in NATS_ROLES:
            users.append({"user": user, "password": credential.password,
                          "permissions": nats_permissions(user, run)})
    return "authorization " + json.dumps({"users": users}, indent=2) + "\n"


# -- Redis ---------------------------------------------------------------------------------------


def redis_key_patterns(role: str, run: str = "*") -> list[str]:
    return [f"rlfleet:{run}:{part}" + suffix for part in REDIS_ROLES[role] for suffix in ("", ":*")]


def redis_acl(infra: InfraSecrets, run: str = "*", superusers: tuple[str, ...] = ()) -> str:
    """An ACL file: `default` off, one user per service with its key patterns. Passwords are stored
    as SHA-256 (`#<hex>`), so the file alone does not give them away.

    `default` is off (no client can log in as it, and connections start unauthenticated) but holds
    every permission: Redis replays its append-only file as `default`, and EXEC checks the ACL again
    (Redis 7, redis/redis#14541), so with `-@all` every MULTI/EXEC of the AOF was refused on a
    restart and its writes were lost (the gateway's engine registry, session state)."""
    lines = ["user default off allkeys allchannels +@all"]
    for user, credential in infra.redis.items():
        digest = hashlib.sha256(credential.password.encode()).hexdigest()
        if user in superusers:
            keys = "~rlfleet:*"
        elif user in REDIS_ROLES:
            keys = " ".join("~" + pattern for pattern in redis_key_patterns(user, run))
            keys += "".join(f" %R~rlfleet:{run}:{part}" + suffix for part in REDIS_READ_ROLES.get(user, ())
                            for suffix in ("", ":*"))
        else:
            continue
        lines.append(f"user {user} on #{digest} resetkeys {keys} resetchannels +@all -@dangerous")
    return "\n".join(lines) + "\n"
