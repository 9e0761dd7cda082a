"""Async clients of the session, sandbox and verifier services over the generated stubs.

Each method is one RPC with a deadline; a failed call raises the matching
:mod:`rlfleet.envkit.sdk.errors` class instead of a raw ``grpc.aio.AioRpcError``. ``Clients``
bundles the three over one channel each:

    async with Clients.connect(session="127.0.0.1:7002", sandbox=..., verifier=...) as clients:
        sandbox = await clients.sandbox.create(session_id="s1")
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from rlfleet.api.session.v1 import session_pb2, session_pb2_grpc
from rlfleet.api.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from rlfleet.common import security
from rlfleet.common.config import require
from rlfleet.common.errors import StartupError
from rlfleet.common.grpc_server import channel
from rlfleet.envkit.sdk.errors import RpcNotFound, translate


@dataclass(frozen=True)
class RpcTimeouts:
    """Deadlines of single calls (seconds); an episode's own time limit is enforced on top."""

    open_s: float = 30.0
    generate_s: float = 300.0  # queueing behind other sessions on a busy engine included
    append_s: float = 30.0
    sandbox_s: float = 30.0
    exec_margin_s: float = 10.0  # on top of the exec's own time limit
    verify_s: float = 120.0
    close_s: float = 30.0


class _Client:
    service = ""
    _stub: object  # the service's generated stub, made by each client; `_call` looks methods up by name

    def __init__(self, ch: grpc.aio.Channel, timeouts: RpcTimeouts) -> None:
        self.channel = ch
        self.timeouts = timeouts

    async def _call(self, method: str, request: Any, timeout_s: float, metadata: Any = None) -> Any:
        try:
            return await getattr(self._stub, method)(request, timeout=timeout_s, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            raise translate(self.service, method, exc) from None


class SessionClient(_Client):
    service = "session"

    def __init__(self, ch: grpc.aio.Channel, timeouts: RpcTimeouts) -> None:
        super().__init__(ch, timeouts)
        self._stub = session_pb2_grpc.SessionServiceStub(ch)

    async def open(self, request: session_pb2.OpenSessionRequest) -> session_pb2.OpenSessionResponse:
        return await self._call("OpenSession", request, self.timeouts.open_s)

    async def generate(self, session_id: str, sampling: common_pb2.SamplingParams | None = None,
                       timeout_s: float | None = None,
                       observation: str | session_pb2.AppendObservationRequest | None = None,
                       ) -> session_pb2.GenerateResponse:
        """The next turn; `observation` (text, tokenized once as is, or a full request: chat messages
        the server frames) is appended first in the same call."""
        request = session_pb2.GenerateRequest(session_id=session_id, sampling=sampling)
        if isinstance(observation, str):
            request.observation.text = observation
        elif observation is not None:
            request.observation.CopyFrom(observation)
        return await self._call("Generate", request, timeout_s or self.timeouts.generate_s)

    async def append_text(self, session_id: str, text: str) -> session_pb2.AppendObservationResponse:
        """Appends `text` tokenized once, as is (the caller frames it as the chat template would)."""
        request = session_pb2.AppendObservationRequest(session_id=session_id, text=text)
        return await self._call("AppendObservation", request, self.timeouts.append_s)

    async def append_messages(self, session_id: str, messages: list[dict[str, str]],
                              add_generation_prompt: bool = True) -> session_pb2.AppendObservationResponse:
        """Appends messages rendered by the server's chat template."""
        request = session_pb2.AppendObservationRequest(
            session_id=session_id, messages=chat_messages(messages),
            add_generation_prompt=add_generation_prompt)
        return await self._call("AppendObservation", request, self.timeouts.append_s)

    async def get(self, session_id: str) -> session_pb2.Session | None:
        """The session, or None when the server does not know it."""
        try:
            return await self._call("GetSession", session_pb2.GetSessionRequest(session_id=session_id),
                                    self.timeouts.open_s)
        except RpcNotFound:
            return None

    async def close(self, session_id: str,
                    status: common_pb2.TrajectoryStatus = common_pb2.TRAJECTORY_STATUS_COMPLETED,
                    metadata: Mapping[str, str] | None = None) -> session_pb2.CloseSessionResponse:
        request = session_pb2.CloseSessionRequest(session_id=session_id, status=status,
                                                  metadata=metadata or {})
        return await self._call("CloseSession", request, self.timeouts.close_s)

    async def abort(self, session_id: str, reason: str) -> session_pb2.AbortSessionResponse:
        request = session_pb2.AbortSessionRequest(session_id=session_id, reason=reason)
        return await self._call("AbortSession", request, self.timeouts.close_s)


class SandboxClient(_Client):
    """`client_id` is who this process is to the sandbox manager, whose per-client cap on open
    sandboxes counts by it (default: this host and process, so workers do not share one cap)."""

    service = "sandbox"

    def __init__(self, ch: grpc.aio.Channel, timeouts: RpcTimeouts, client_id: str = "") -> None:
        super().__init__(ch, timeouts)
        self._stub = sandbox_pb2_grpc.SandboxServiceStub(ch)
        self.client_id = client_id or f"env-{socket.gethostname()}-{os.getpid()}"

    async def create(self, session_id: str = "", labels: Mapping[str, str] | None = None,
                     files: Mapping[str, bytes | str] | None = None,
                     ttl_s: float = 0.0) -> sandbox_pb2.Sandbox:
        request = sandbox_pb2.CreateSandboxRequest(
            session_id=session_id, labels=labels or {}, files=sandbox_files(files or {}), ttl_seconds=ttl_s)
        return await self._call("CreateSandbox", request, self.timeouts.sandbox_s,
                                metadata=(("rlfleet-client-id", self.client_id),))

    async def exec(self, sandbox_id: str, argv: list[str] | tuple[str, ...], stdin: bytes | str = b"",
                   timeout_s: float = 0.0, cwd: str = "") -> sandbox_pb2.ExecResult:
        data = stdin.encode() if isinstance(stdin, str) else stdin
        request = sandbox_pb2.ExecRequest(sandbox_id=sandbox_id, argv=list(argv), stdin=data,
                                          timeout_seconds=timeout_s, cwd=cwd)
        deadline = (timeout_s or self.timeouts.sandbox_s) + self.timeouts.exec_margin_s
        return await self._call("Exec", request, deadline)

    async def write_files(self, sandbox_id: str, files: Mapping[str, bytes | str]) -> None:
        request = sandbox_pb2.WriteFilesRequest(sandbox_id=sandbox_id, files=sandbox_files(files))
        await self._call("WriteFiles", request, self.timeouts.sandbox_s)

    async def read_files(self, sandbox_id: str, paths: list[str]) -> dict[str, bytes]:
        reply = await self._call("ReadFiles",
                                 sandbox_pb2.ReadFilesRequest(sandbox_id=sandbox_id, paths=paths),
                                 self.timeouts.sandbox_s)
        return {f.path: f.content for f in reply.files}

    async def get(self, sandbox_id: str) -> sandbox_pb2.Sandbox:
        return await self._call("GetSandbox", sandbox_pb2.GetSandboxRequest(sandbox_id=sandbox_id),
                                self.timeouts.sandbox_s)

    async def destroy(self, sandbox_id: str) -> None:
        await self._call("DestroySandbox", sandbox_pb2.DestroySandboxRequest(sandbox_id=sandbox_id),
                         self.timeouts.sandbox_s)


class VerifierClient(_Client):
    service = "verifier"

    def __init__(self, ch: grpc.aio.Channel, timeouts: RpcTimeouts) -> None:
        super().__init__(ch, timeouts)
        self._stub = verifier_pb2_grpc.VerifierServiceStub(ch)

    async def verify(self, session_id: str, suite: str, task_id: str,
                     sandbox_id: str = "") -> common_pb2.Verdict:
        """Asks for the episode's verdict; the verifier reads the session and sandbox itself."""
        request = verifier_pb2.VerifyRequest(session_id=session_id, suite=suite, task_id=task_id,
                                             sandbox_id=sandbox_id)
        return await self._call("Verify", request, self.timeouts.verify_s)

    async def get_verdict(self, session_id: str) -> common_pb2.Verdict | None:
        try:
            return await self._call("GetVerdict", verifier_pb2.GetVerdictRequest(session_id=session_id),
                                    self.timeouts.verify_s)
        except RpcNotFound:
            return None


def credentials_from(token: str, ca_file: str) -> security.Credentials:
    """Given a token: that client's credentials (the CA from `ca_file`, else the environment's);
    else this process's own (`security.local_credentials`)."""
    if not token:
        return security.local_credentials()
    ca_path = (ca_file or os.environ.get(security.CA_ENV, "")
               or str((security.secrets_dir() or Path()) / "ca.pem"))
    if not Path(ca_path).exists():
        raise StartupError(f"no CA certificate at {ca_path!r}: give --ca-file (the run's secrets/ca.pem)")
    return security.client_credentials(token, Path(ca_path).read_bytes())


class Clients:
    """The three clients an environment needs; `async with` closes their channels."""

    def __init__(self, session: SessionClient, sandbox: SandboxClient, verifier: VerifierClient,
                 channels: list[grpc.aio.Channel], credentials: security.Credentials | None = None) -> None:
        self.credentials = credentials  # what the channels call with (None: this process's own)
        self.session = session
        self.sandbox = sandbox
        self.verifier = verifier
        self._channels = channels

    @classmethod
    def connect(cls, *, session: str, sandbox: str, verifier: str,
                timeouts: RpcTimeouts | None = None, token: str = "", ca_file: str = "") -> Clients:
        """Opens a channel per address (lazily connected); an empty address fails fast.

        The channels are TLS and call with `token` (an environment client's, `rlfleet token issue`)
        checked against the run's CA certificate `ca_file`; without them, the environment's
        (RLFLEET_TOKEN, RLFLEET_CA_FILE, or the run's secrets directory)."""
        timeouts = timeouts or RpcTimeouts()
        creds = credentials_from(token, ca_file)
        # Sandboxes live on the manager replica that created them, so that channel stays on one replica
        # (pick_first); sessions and verdicts are in Redis, so any replica serves those calls.
        channels = [channel(require(session, "session_address"), credentials=creds),
                    channel(require(sandbox, "sandbox_address"), balance=False, credentials=creds),
                    channel(require(verifier, "verifier_address"), credentials=creds)]
        return cls(SessionClient(channels[0], timeouts), SandboxClient(channels[1], timeouts),
                   VerifierClient(channels[2], timeouts), channels, creds)

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()

    async def __aenter__(self) -> Clients:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def chat_messages(messages: list[dict[str, str]]) -> common_pb2.ChatMessages:
    return common_pb2.ChatMessages(
        messages=[common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages])


def sandbox_files(files: Mapping[str, bytes | str]) -> list[sandbox_pb2.File]:
    return [sandbox_pb2.File(path=path, content=content.encode() if isinstance(content, str) else content)
            for path, content in files.items()]
