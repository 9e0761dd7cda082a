"""Who is calling: a run's certificates, environment-client tokens and the principal of each call.

A run's trust material lives in `<run_dir>/secrets/` (directory 0700, files 0600), made on the
first start of `rlfleet up` / `rlfleet run` (`ensure_secrets`):

- `ca.pem` / `ca.key`: the run's own certificate authority (EC P-256, made with the `openssl`
  command line, which every Debian machine has);
- `certs/<identity>.pem`: key and certificate of one service (`session-server`, `trainer`, ...) or
  of the `operator` (the CLI), signed by the CA, with the local and in-cluster host names as SANs;
  made the first time a process of that identity starts;
- `token.key`: the HMAC key environment-client tokens are signed with; `tokens.jsonl` lists the
  tokens issued, `revoked` the ids revoked (every process on the run reads the same file, and
  notices a change within a second; processes on other hosts see the same ids through the run's
  Redis, rlfleet.common.revocations).

Services talk mutual TLS: the client certificate names the caller. An environment client (other
teams' code, any language) has only the CA certificate and a token, sent as `authorization: Bearer
<token>`; a token is bound to one run and one client name, and is revocable. Services and the
operator also send a token they sign themselves, so that servers an environment client can reach
(which cannot demand a client certificate of it) still know them.

Which process this is (`set_identity`) comes from the entry point's name; a process with the
secrets directory and no identity is the operator. A process with a token in `RLFLEET_TOKEN` calls
as that token's client.
"""

from __future__ import annotations

import base64
import contextvars
import hashlib
import hmac
import json
import os
import secrets
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlfleet.common.errors import InvalidArgument, StartupError, Unauthenticated

SECRETS_ENV = "RLFLEET_SECRETS_DIR"  # a run's secrets directory: this process is a service or the operator
TOKEN_ENV = "RLFLEET_TOKEN"  # an environment client's token
CA_ENV = "RLFLEET_CA_FILE"  # an environment client's copy of the run's CA certificate
HOSTS_ENV = "RLFLEET_TLS_HOSTS"  # extra names for the certificates, comma-separated
# Only bench/service_path.py sets it, to measure what TLS and the access checks cost: servers then
# listen in plaintext and let every caller do everything. Each server logs a warning when it is set.
PLAINTEXT_ENV = "RLFLEET_INSECURE_PLAINTEXT_FOR_BENCHMARKS"

ENVIRONMENT, OPERATOR, SERVICE = "environment", "operator", "service"
ANY_RUN = "*"
TOKEN_PREFIX = "rlf1"
# The names services reach each other by: localhost, compose service names, Kubernetes services.
SERVICE_HOSTS = ("localhost", "session-server", "rollout-gateway", "gateway", "sandbox-manager", "verifier",
                 "trainer", "weight-broker", "broker", "cpu-engine", "engine", "nats", "redis")
# NATS and Redis: their certificates serve TLS and nothing else (serverAuth only), so the key on the
# NATS or Redis host is no client certificate a gRPC server would take as a service.
INFRA_IDENTITIES = ("nats", "redis")
# The NATS cluster's routes: their own CA (nats-route-ca.pem / .key) and certificate (certs/nats-route.pem).
NATS_ROUTE_CA, NATS_ROUTE_IDENTITY = "nats-route-ca", "nats-route"
SERVICE_IPS = ("127.0.0.1", "::1")
CERT_DAYS = 825
ENGINE_KEY_FILES = ("engine_api_key", "engine_admin_api_key")


@dataclass(frozen=True)
class Principal:
    """Who a call comes from: `kind` is environment, operator or service; `name` the client or
    service name; `run` the run it may touch (ANY_RUN for services and the operator)."""

    kind: str
    name: str
    run: str = ANY_RUN
    token_id: str = ""

    @property
    def owner(self) -> str:
        """What a session or sandbox it creates records as its owner: a client's name in its run
        (the same name in another run is another owner)."""
        return f"{self.kind}:{self.name}" + ("" if self.run == ANY_RUN else f"@{self.run}")

    @property
    def trusted(self) -> bool:
        """Services and the operator see every session and sandbox; a client only its own."""
        return self.kind != ENVIRONMENT

    def may_use_run(self, run_id: str) -> bool:
        return self.run == ANY_RUN or not run_id or run_id == self.run

    def may_own(self, owner: str, run_id: str = "") -> bool:
        """Whether a thing recorded as `owner` (in `run_id`) is this caller's to see."""
        return self.trusted or (owner == self.owner and self.may_use_run(run_id))

    def roles(self) -> tuple[str, ...]:
        return (self.kind, f"{self.kind}:{self.name}")


_caller: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("rlfleet_caller", default=None)
# In-process calls (a servicer called directly by a test or by its own process) are the process's own.
LOCAL = Principal(SERVICE, "local")


def caller() -> Principal:
    """The principal of the RPC being served (set by the server's interceptor)."""
    return _caller.get() or LOCAL


def set_caller(principal: Principal | None) -> contextvars.Token:
    return _caller.set(principal)


def caller_metadata() -> tuple[tuple[str, str], ...]:
    """Call metadata that makes a peer call on the current caller's behalf (the verifier reads a
    session as the client that asked for the verdict, so it sees only that client's sessions)."""
    principal = _caller.get()
    token = _forwarded.get()
    if principal is None or principal.trusted or not token:
        return ()
    return (("authorization", f"Bearer {token}"),)


_forwarded: contextvars.ContextVar[str] = contextvars.ContextVar("rlfleet_forwarded_token", default="")


# -- files ---------------------------------------------------------------------------------------


def _write_private(path: Path, data: bytes) -> None:
    """Written to a temporary file created 0600 and renamed, so it is never readable by others
    nor seen half written."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    tmp.replace(path)


def _openssl(*args: str, cwd: Path) -> None:
    try:
        subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)
    except FileNotFoundError:
        raise StartupError("the openssl command is not installed (apt-get install openssl)") from None
    except subprocess.CalledProcessError as exc:
        raise StartupError(f"openssl {args[0]} failed: "
                           f"{exc.stderr.decode(errors='replace')[-300:]}") from None


def ensure_secrets(directory: str | Path, run_id: str = "") -> Path:
    """Makes the run's CA and token key in `directory` unless they exist; returns it."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(root, 0o700)
    _ensure_ca(root, "ca", f"rlfleet run CA {run_id or secrets.token_hex(4)}")
    if not (root / "token.key").exists():
        _write_private(root / "token.key", secrets.token_hex(32).encode())
    for name in ENGINE_KEY_FILES:  # SGLang's --api-key and --admin-api-key of the run's engines
        if not (root / name).exists():
            _write_private(root / name, secrets.token_urlsafe(32).encode())
    if run_id and not (root / "run_id").exists():
        _write_private(root / "run_id", run_id.encode())
    return root


def _ensure_ca(root: Path, stem: str, subject: str) -> None:
    """`<stem>.pem` / `<stem>.key`: a certificate authority, made unless it exists."""
    if (root / f"{stem}.pem").exists():
        return
    with tempfile.TemporaryDirectory(dir=root) as work:
        _openssl("req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                 "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", str(CERT_DAYS),
                 "-subj", f"/CN={subject}", "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=Path(work))
        _write_private(root / f"{stem}.key", (Path(work) / "ca.key").read_bytes())
        _write_private(root / f"{stem}.pem", (Path(work) / "ca.pem").read_bytes())


def _hosts() -> list[str]:
    extra = [h.strip() for h in os.environ.get(HOSTS_ENV, "").split(",") if h.strip()]
    return sorted({*SERVICE_HOSTS, socket.gethostname(), *extra})


def identity_pem(directory: str | Path, identity: str, ca: str = "ca",
                 hosts: list[str] | None = None) -> bytes:
    """Key and certificate of `identity`, one PEM file; made (and signed by the CA `ca`, the run's
    unless told) when missing, with `hosts` (default: the service names) as its SANs."""
    root = Path(directory)
    path = root / "certs" / f"{identity}.pem"
    if path.exists():
        return path.read_bytes()
    usage = "serverAuth" if identity in INFRA_IDENTITIES else "serverAuth,clientAuth"
    if not (root / f"{ca}.key").exists():
        raise StartupError(f"{root} has no CA key ({ca}.key) to sign a certificate for {identity!r}")
    sans = ",".join([*(f"DNS:{h}" for h in (_hosts() if hosts is None else hosts)),
                     *(f"IP:{ip}" for ip in SERVICE_IPS)])
    with tempfile.TemporaryDirectory(dir=root) as work:
        _openssl("req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                 "-nodes", "-keyout", "leaf.key", "-out", "leaf.pem", "-days", str(CERT_DAYS),
                 "-subj", f"/CN={identity}",
                 "-CA", str(root / f"{ca}.pem"), "-CAkey", str(root / f"{ca}.key"),
                 "-addext", f"subjectAltName={sans}", "-addext", "basicConstraints=critical,CA:FALSE",
                 "-addext", f"extendedKeyUsage={usage}", cwd=Path(work))
        pem = (Path(work) / "leaf.key").read_bytes() + (Path(work) / "leaf.pem").read_bytes()
    _write_private(path, pem)
    return pem


def nats_route_pem(directory: str | Path, hosts: list[str]) -> bytes:
    """Key and certificate the servers of a NATS cluster present to each other on their routes
    (mutual TLS, `cluster { tls { verify: true } }`), signed by a CA of their own (NATS_ROUTE_CA):
    with the run's CA a service's client certificate would join the cluster as a route, beneath
    every subject permission, and a route's certificate would call gRPC as a service. `hosts`: the
    names the servers reach each other by (the StatefulSet's pods under the headless Service)."""
    root = Path(directory)
    _ensure_ca(root, NATS_ROUTE_CA, "rlfleet NATS route CA")
    return identity_pem(root, NATS_ROUTE_IDENTITY, ca=NATS_ROUTE_CA, hosts=hosts)


def split_pem(pem: bytes) -> tuple[bytes, bytes]:
    """(private key, certificate) of a PEM file holding both."""
    marker = b"-----BEGIN CERTIFICATE-----"
    at = pem.index(marker)
    return pem[:at], pem[at:]


# -- tokens --------------------------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sign_token(key: bytes, principal: Principal, expires_at: float = 0.0) -> str:
    payload = _b64(json.dumps({"id": principal.token_id or secrets.token_hex(8), "kind": principal.kind,
                               "name": principal.name, "run": principal.run, "exp": expires_at},
                              separators=(",", ":")).encode())
    signature = _b64(hmac.new(key, payload.encode(), hashlib.sha256).digest())
    return f"{TOKEN_PREFIX}.{payload}.{signature}"


@dataclass
class TokenBook:
    """The run's token key and revocations; verified tokens are cached (the revocation list is
    re-read when its file changes, looked at most once a second)."""

    directory: Path
    key: bytes
    _verified: dict[str, Principal] = field(default_factory=dict)
    _revoked: frozenset[str] = frozenset()
    _revoked_stamp: float = -1.0
    _checked_at: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # Ids revoked in the run's Redis (rlfleet.common.revocations.watch keeps it current): how a
    # revocation reaches a container or pod that has its own copy of the secrets.
    remote_revoked: frozenset[str] = frozenset()

    @classmethod
    def load(cls, directory: str | Path) -> TokenBook:
        root = Path(directory)
        return cls(root, (root / "token.key").read_bytes().strip())

    def verify(self, token: str) -> Principal:
        self._refresh_revoked()
        principal = self._verified.get(token)
        if principal is None:
            principal = self._check(token)
            if len(self._verified) > 10_000:
                self._verified.clear()
            self._verified[token] = principal
        if principal.token_id in self._revoked or principal.token_id in self.remote_revoked:
            raise Unauthenticated(f"token {principal.token_id} was revoked", right="authenticated")
        return principal

    def _check(self, token: str) -> Principal:
        parts = token.split(".")
        if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
            raise Unauthenticated("the bearer token is not an rlfleet token", right="authenticated")
        expected = _b64(hmac.new(self.key, parts[1].encode(), hashlib.sha256).digest())
        if not hmac.compare_digest(expected, parts[2]):
            raise Unauthenticated("the bearer token is not one of this run's (bad signature)",
                                  right="authenticated")
        body = json.loads(_unb64(parts[1]))
        if body.get("exp") and body["exp"] < time.time():
            raise Unauthenticated(f"token {body['id']} expired", right="authenticated")
        return Principal(body["kind"], body["name"], body["run"], body["id"])

    def _refresh_revoked(self) -> None:
        now = time.monotonic()
        if now - self._checked_at < 1.0:
            return
        with self._lock:
            self._checked_at = now
            path = self.directory / "revoked"
            try:
                stamp = path.stat().st_mtime_ns
            except FileNotFoundError:
                stamp = 0
            if stamp != self._revoked_stamp:
                lines = path.read_text().split() if stamp else []
                self._revoked, self._revoked_stamp = frozenset(lines), stamp


def issue_token(directory: str | Path, run_id: str, name: str, expires_in_s: float = 0.0) -> tuple[str, dict]:
    """A new environment-client token for `run_id`, recorded in `tokens.jsonl` (without the token
    itself: only its id, so the list is no credential)."""
    root = Path(directory)
    if not name or len(name) > 64 or not all(c.isalnum() or c in "-_." for c in name):
        raise InvalidArgument(f"a client name is 1-64 letters, digits and -_., got {name!r}", field="name")
    token_id = secrets.token_hex(8)
    expires_at = time.time() + expires_in_s if expires_in_s else 0.0
    token = sign_token(TokenBook.load(root).key, Principal(ENVIRONMENT, name, run_id, token_id), expires_at)
    record = {"id": token_id, "name": name, "run": run_id, "issued_at": time.time(), "expires_at": expires_at}
    with _locked_append(root / "tokens.jsonl") as out:
        out.write(json.dumps(record) + "\n")
    return token, record


def revoke_token(directory: str | Path, token_id: str) -> None:
    root = Path(directory)
    if token_id not in {t["id"] for t in list_tokens(root)}:
        raise InvalidArgument(f"no token {token_id!r} was issued in {root}", field="token_id")
    with _locked_append(root / "revoked") as out:
        out.write(token_id + "\n")


def list_tokens(directory: str | Path) -> list[dict]:
    root = Path(directory)
    path = root / "tokens.jsonl"
    revoked = set((root / "revoked").read_text().split()) if (root / "revoked").exists() else set()
    rows = ([json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            if path.exists() else [])
    return [{**row, "revoked": row["id"] in revoked} for row in rows]


class _locked_append:
    """An append-only secrets file, 0600, under an exclusive lock (two `rlfleet token` at once)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self):
        import fcntl

        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.file = os.fdopen(fd, "a")
        fcntl.flock(self.file, fcntl.LOCK_EX)
        return self.file

    def __exit__(self, *exc: object) -> None:
        self.file.close()


# -- this process's credentials ------------------------------------------------------------------


@dataclass
class Credentials:
    """What one process presents and checks: the CA, its key and certificate (services and the
    operator), the token it sends, and the token book (only where the run's secrets are)."""

    ca: bytes
    token: str
    key: bytes = b""
    cert: bytes = b""
    book: TokenBook | None = None
    identity: str = ""
    cert_file: str = ""  # the key and certificate as one PEM file: what ssl and redis-py load


_identity = "operator"
_cached: dict[str, Credentials] = {}
_cache_lock = threading.Lock()


def set_identity(process_name: str) -> None:
    """The service this process is, from its entry point's name (`rlfleet-session-server`)."""
    global _identity
    _identity = process_name.removeprefix("rlfleet-") or "operator"
    _cached.clear()


def identity() -> str:
    return _identity


def adopt_mounted_identity() -> str:
    """A helper process beside a service in its container (the health check, the engine registrar)
    presents that service's certificate: the only one in the secrets directory's certs/, when just
    one is there (compose and Kubernetes mount one per container); else it stays the operator."""
    directory = secrets_dir()
    certs = sorted((directory / "certs").glob("*.pem")) if directory is not None else []
    if len(certs) == 1:
        set_identity(certs[0].stem)
    return _identity


def trusted_credentials(directory: str | Path, name: str) -> Credentials:
    """A service's (or the operator's) credentials from the run's secrets directory."""
    root = Path(directory)
    if not (root / "ca.pem").exists():
        raise StartupError(f"{root} has no run CA (ca.pem); `rlfleet up` makes one")
    key, cert = split_pem(identity_pem(root, name))
    book = TokenBook.load(root)
    kind = OPERATOR if name == "operator" else SERVICE
    token = sign_token(book.key, Principal(kind, name, ANY_RUN, f"{kind}-{name}"))
    return Credentials((root / "ca.pem").read_bytes(), token, key, cert, book, name,
                       str(root / "certs" / f"{name}.pem"))


def client_credentials(token: str, ca: bytes) -> Credentials:
    """An environment client's: the run's CA certificate and its token."""
    return Credentials(ca, token)


def local_credentials() -> Credentials:
    """This process's credentials: a token in RLFLEET_TOKEN calls as that client; otherwise the
    run's secrets directory (RLFLEET_SECRETS_DIR) makes this process its identity."""
    directory = os.environ.get(SECRETS_ENV, "")
    token = os.environ.get(TOKEN_ENV, "")
    cache_key = f"{directory}|{token}|{_identity}"
    with _cache_lock:
        if cache_key not in _cached:
            _cached[cache_key] = _resolve(directory, token)
        return _cached[cache_key]


def _resolve(directory: str, token: str) -> Credentials:
    # A container (compose, Kubernetes) gets its identity's certificate made up front and no CA key.
    if directory and (Path(directory, "ca.key").exists()
                      or Path(directory, "certs", f"{_identity}.pem").exists()):
        found = trusted_credentials(directory, _identity)
        if token:
            found.token = token
        return found
    ca_file = os.environ.get(CA_ENV, "") or (str(Path(directory, "ca.pem")) if directory else "")
    if not token or not ca_file or not Path(ca_file).exists():
        raise StartupError(
            "no credentials: an environment client needs the run's CA certificate (RLFLEET_CA_FILE or "
            "--ca-file) and a token (RLFLEET_TOKEN or --token; `rlfleet token issue` makes one); a service "
            f"needs the run's secrets directory ({SECRETS_ENV}; `rlfleet up` makes it)")
    return client_credentials(token, Path(ca_file).read_bytes())


def client_ssl_context(ca_file: str = "", credentials: Credentials | None = None) -> ssl.SSLContext:
    """What a NATS or Redis client of this process connects with: the run's CA (`ca_file`, else this
    process's credentials') to check the server by, and this process's certificate where it has one
    (services and the operator; Redis demands it, NATS takes a login instead: workers have none).
    A process with neither secrets nor a token (`rlfleet-submit` in a container) checks by
    RLFLEET_CA_FILE. `credentials`: another's than this process's (the operator's of a run directory)."""
    if (credentials is None and not ca_file and not os.environ.get(SECRETS_ENV)
            and not os.environ.get(TOKEN_ENV)):
        ca_file = os.environ.get(CA_ENV, "")
    if ca_file:
        try:
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
        except OSError as exc:
            raise StartupError(f"cannot read the CA certificate {ca_file}: {exc.strerror}") from None
        cert_file = ""
        try:
            cert_file = local_credentials().cert_file
        except StartupError:
            pass  # a CA file and no secrets: a client without a certificate of its own
    else:
        creds = credentials or local_credentials()
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=creds.ca.decode())
        cert_file = creds.cert_file
    if cert_file:
        context.load_cert_chain(cert_file)
    return context


def server_tls_files(directory: str | Path, identity: str) -> tuple[str, str]:
    """(key and certificate PEM, CA certificate) that nats-server or redis-server (`identity`)
    serves TLS with, made in the run's secrets `directory` when missing."""
    root = Path(directory)
    identity_pem(root, identity)
    return str(root / "certs" / f"{identity}.pem"), str(root / "ca.pem")


def ensure_local_credentials(directory: str | Path | None = None) -> Path:
    """The secrets directory this process and its children use; one is made (in `directory`, else a
    temporary one) when none is set. What tests and benchmarks run under, so they need nothing set up
    by hand and still go over TLS with tokens."""
    current = os.environ.get(SECRETS_ENV, "")
    if current and Path(current, "ca.key").exists():
        return Path(current)
    root = ensure_secrets(directory or tempfile.mkdtemp(prefix="rlfleet-secrets-"), "local")
    os.environ[SECRETS_ENV] = str(root)
    _cached.clear()
    return root


def engine_keys() -> tuple[str, str]:
    """(api key, admin api key) of the run's engines, from the secrets directory; ("", "") without one."""
    directory = secrets_dir()
    if directory is None or not (directory / ENGINE_KEY_FILES[0]).exists():
        return "", ""
    api, admin = ((directory / name).read_text().strip() for name in ENGINE_KEY_FILES)
    return api, admin


def plaintext() -> bool:
    return os.environ.get(PLAINTEXT_ENV, "") == "1"


def secrets_dir() -> Path | None:
    value = os.environ.get(SECRETS_ENV, "")
    return Path(value) if value else None


def run_secrets_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "secrets"


def run_credentials(run_dir: str | Path) -> Credentials | None:
    """The operator's credentials for the platform launched in `run_dir`; None when it has no secrets."""
    directory = run_secrets_dir(run_dir)
    return trusted_credentials(directory, "operator") if (directory / "ca.key").exists() else None
