"""The verifier's peers over gRPC: the session server (episodes) and the sandbox manager (files, violations,
a fresh sandbox for hidden tests). Their failures become our error kinds here, at the boundary."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import grpc

from rlfleet.api.sandbox.v1 import sandbox_pb2 as sbx
from rlfleet.api.sandbox.v1 import sandbox_pb2_grpc
from rlfleet.api.session.v1 import session_pb2, session_pb2_grpc
from rlfleet.common import security
from rlfleet.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from rlfleet.common.grpc_server import channel
from rlfleet.common.stored_sessions import SESSION_ID, SESSION_ID_RULE, read_session
from rlfleet.verifier.config import TestSandboxSection
from rlfleet.verifier.kinds import TestRunRequest, TestRunResult, Violation

log = logging.getLogger(__name__)


def translate(exc: grpc.aio.AioRpcError, peer: str, what: str) -> Exception:
    code, details = exc.code(), exc.details()
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFound(f"{what} not found ({peer}: {details})")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(f"{what}: {details}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhausted(f"{peer} is at capacity: {details}")
    return Unavailable(f"{peer} failed on {what}: {code.name} {details}")


class _Peer:
    name = ""
    balanced = True  # any replica serves this peer's state (it lives in Redis)

    def __init__(self, address: str, setting: str, timeout_s: float) -> None:
        self.address = address
        self.setting = setting
        self.timeout_s = timeout_s
        self._channel: grpc.aio.Channel | None = None

    def _open(self) -> grpc.aio.Channel:
        if not self.address:
            raise FailedPrecondition(f"this verifier has no {self.name} to ask: set {self.setting}")
        if self._channel is None:
            self._channel = channel(self.address, balance=self.balanced)
        return self._channel

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()


class SessionPeer(_Peer):
    name = "session server"

    async def session(self, session_id: str) -> session_pb2.Session:
        stub = session_pb2_grpc.SessionServiceStub(self._open())
        try:
            # On the asking client's behalf: it sees only its own sessions (no verdict on another's).
            return await stub.GetSession(session_pb2.GetSessionRequest(session_id=session_id),
                                         timeout=self.timeout_s, metadata=security.caller_metadata())
        except grpc.aio.AioRpcError as exc:
            raise translate(exc, self.name, f"session {session_id!r}") from None


class StoredSessions:
    """The sessions where the session server keeps them (its Redis hash `rlfleet:<run>:session:<id>`,
    rlfleet.session.store), read straight from there: one Redis read instead of a GetSession round
    trip through the session server. The verifier's Redis user may only read those keys, and only
    the session server writes them, so what is scored is still what the session server vouches for;
    the owner check is the session server's own (a client sees only its own sessions)."""

    def __init__(self, redis, run_id: str) -> None:
        self.redis = redis
        self.run_id = run_id

    async def session(self, session_id: str) -> session_pb2.Session:
        if not SESSION_ID.match(session_id):
            raise InvalidArgument(f"session_id must be {SESSION_ID_RULE}, got {session_id!r}",
                                  field="session_id")
        session = await read_session(self.redis, self.run_id, session_id)
        if session is None:  # as at the session server: another client's session is not found, not refused
            raise NotFound(f"session {session_id!r} not found (session store)")
        return session

    async def close(self) -> None:
        pass


class SandboxPeer(_Peer):
    balanced = False  # a sandbox exists only on the manager replica that created it
    name = "sandbox manager"

    def __init__(self, address: str, setting: str, timeout_s: float, tests: TestSandboxSection) -> None:
        super().__init__(address, setting, timeout_s)
        self.tests = tests

    @property
    def stub(self) -> sandbox_pb2_grpc.SandboxServiceStub:
        return sandbox_pb2_grpc.SandboxServiceStub(self._open())

    async def violations(self, sandbox_id: str) -> list[Violation]:
        try:
            box = await self.stub.GetSandbox(sbx.GetSandboxRequest(sandbox_id=sandbox_id),
                                             timeout=self.timeout_s, metadata=security.caller_metadata())
        except grpc.aio.AioRpcError as exc:
            raise translate(exc, self.name, f"sandbox {sandbox_id!r}") from None
        return [Violation(sbx.ViolationKind.Name(v.kind).removeprefix("VIOLATION_KIND_").lower(), v.message)
                for v in box.violations]

    async def read_files(self, sandbox_id: str, paths: Sequence[str]) -> dict[str, bytes]:
        """The candidate files that exist in the policy's sandbox (missing ones are left out)."""
        request = sbx.ReadFilesRequest(sandbox_id=sandbox_id, paths=list(paths),
                                       max_bytes_per_file=self.tests.max_solution_bytes)
        try:
            reply = await self.stub.ReadFiles(request, timeout=self.timeout_s,
                                              metadata=security.caller_metadata())
        except grpc.aio.AioRpcError as exc:
            raise translate(exc, self.name, f"files of sandbox {sandbox_id!r}") from None
        return {f.path: f.content for f in reply.files}

    async def run_tests(self, request: TestRunRequest, session_id: str = "") -> TestRunResult:
        """Runs the harness in a fresh sandbox holding only the candidate's files (the hidden tests go on
        its stdin, never to its disk), then destroys it."""
        files = [sbx.File(path=path, content=_bytes(content)) for path, content in request.files.items()]
        cpu = max(1.0, float(math.ceil(request.timeout_s)))
        limits = sbx.Limits(cpu_seconds=cpu, wall_seconds=request.timeout_s,
                            memory_bytes=self.tests.memory_bytes,
                            max_processes=self.tests.max_processes,
                            max_output_bytes=self.tests.max_output_bytes)
        create = sbx.CreateSandboxRequest(files=files, limits=limits, ttl_seconds=request.timeout_s + 120,
                                          labels={"purpose": "hidden-tests"}, session_id=session_id)
        try:
            # Named, so the hidden-test sandboxes count against the verifier's own per-client cap, not
            # the one every unnamed caller shares.
            box = await self.stub.CreateSandbox(create, timeout=self.timeout_s,
                                                metadata=(("rlfleet-client-id", "verifier"),))
        except grpc.aio.AioRpcError as exc:
            raise translate(exc, self.name, "a sandbox for the hidden tests") from None
        try:
            result = await self.stub.Exec(sbx.ExecRequest(sandbox_id=box.sandbox_id, argv=list(request.argv),
                                                          stdin=request.stdin),
                                          timeout=request.timeout_s + self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise translate(exc, self.name, "the hidden tests' run") from None
        finally:
            await self._destroy(box.sandbox_id)
        kinds = tuple(sbx.ViolationKind.Name(v.kind).removeprefix("VIOLATION_KIND_").lower()
                      for v in result.violations)
        return TestRunResult(exit_code=result.exit_code, output=result.stdout.decode("utf-8", "replace"),
                             timed_out="timeout" in kinds, violations=kinds)

    async def _destroy(self, sandbox_id: str) -> None:
        try:
            await self.stub.DestroySandbox(sbx.DestroySandboxRequest(sandbox_id=sandbox_id),
                                           timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:  # its TTL reaps it; the verdict does not depend on this
            log.warning("could not destroy the hidden tests' sandbox %s: %s", sandbox_id, exc.details())


def _bytes(content: bytes | str) -> bytes:
    return content.encode() if isinstance(content, str) else bytes(content)

