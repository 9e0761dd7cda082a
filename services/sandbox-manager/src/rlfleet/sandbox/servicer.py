"""SandboxService over gRPC: requests to the manager, results to protos. Errors map at the interceptor."""

from __future__ import annotations

import time

from rlfleet.api.sandbox.v1 import sandbox_pb2 as pb
from rlfleet.api.sandbox.v1 import sandbox_pb2_grpc
from rlfleet.common import security
from rlfleet.common.errors import PermissionDenied
from rlfleet.sandbox.driver import ExecResult
from rlfleet.sandbox.errors import InvalidSandboxRequest
from rlfleet.sandbox.limits import LIMIT_RANGES, Limits
from rlfleet.sandbox.manager import NewFile, RecordedViolation, SandboxManager, SandboxRecord


class SandboxServicer(sandbox_pb2_grpc.SandboxServiceServicer):
    def __init__(self, manager: SandboxManager) -> None:
        self.manager = manager

    async def CreateSandbox(self, request: pb.CreateSandboxRequest, context) -> pb.Sandbox:
        run_id = self.manager.leases.run_id
        principal = security.caller()
        if not principal.may_use_run(run_id):
            raise PermissionDenied(f"the caller's token is for run {principal.run!r}; "
                                   f"this sandbox manager serves run {run_id!r}", right=f"run:{run_id}",
                                   run_id=run_id)
        record = await self.manager.create(
            files=new_files(request.files), limits=requested_limits(request),
            network=request.network, env=dict(request.env), ttl_s=request.ttl_seconds,
            labels=dict(request.labels), session_id=request.session_id,
            client_id=client_id(request, context))
        return sandbox_proto(record)

    async def Exec(self, request: pb.ExecRequest, context) -> pb.ExecResult:
        if not request.argv:
            raise InvalidSandboxRequest("argv must not be empty", field="argv", sandbox_id=request.sandbox_id)
        result = await self.manager.exec(request.sandbox_id, list(request.argv), stdin=request.stdin,
                                         timeout_s=request.timeout_seconds, env=dict(request.env),
                                         cwd=request.cwd)
        return exec_result_proto(result)

    async def WriteFiles(self, request: pb.WriteFilesRequest, context) -> pb.WriteFilesResponse:
        await self.manager.write_files(request.sandbox_id, new_files(request.files))
        return pb.WriteFilesResponse()

    async def ReadFiles(self, request: pb.ReadFilesRequest, context) -> pb.ReadFilesResponse:
        found, missing = await self.manager.read_files(request.sandbox_id, list(request.paths),
                                                       request.max_bytes_per_file)
        return pb.ReadFilesResponse(files=[pb.File(path=p, content=c) for p, c in found.items()],
                                    missing=missing)

    async def ListFiles(self, request: pb.ListFilesRequest, context) -> pb.ListFilesResponse:
        return pb.ListFilesResponse(paths=await self.manager.list_files(request.sandbox_id))

    async def GetSandbox(self, request: pb.GetSandboxRequest, context) -> pb.Sandbox:
        return sandbox_proto(await self.manager.get(request.sandbox_id))

    async def DestroySandbox(self, request: pb.DestroySandboxRequest, context) -> pb.DestroySandboxResponse:
        await self.manager.get(request.sandbox_id)  # the caller's own, or not found
        await self.manager.destroy(request.sandbox_id)
        return pb.DestroySandboxResponse()


# -- conversions -------------------------------------------------------------------------------

CLIENT_ID_METADATA = "rlfleet-client-id"


def client_id(request: pb.CreateSandboxRequest, context) -> str:
    """Who asks, for the per-client cap: an environment client's token name (it cannot name itself
    another), else the `rlfleet-client-id` metadata, else the `client_id` label."""
    principal = security.caller()
    if not principal.trusted:
        return principal.name
    for key, value in (context.invocation_metadata() or ()) if context is not None else ():
        if key == CLIENT_ID_METADATA and value:
            return value
    return request.labels.get("client_id", "")



def new_files(files) -> list[NewFile]:
    return [NewFile(f.path, f.content, f.mode) for f in files]


def requested_limits(request: pb.CreateSandboxRequest) -> dict[str, float]:
    if not request.HasField("limits"):
        return {}
    return {name: getattr(request.limits, name) for name in LIMIT_RANGES}


def limits_proto(limits: Limits) -> pb.Limits:
    return pb.Limits(**{name: getattr(limits, name) for name in LIMIT_RANGES})


def violation_proto(recorded: RecordedViolation) -> pb.Violation:
    v = recorded.violation
    return pb.Violation(kind=pb.ViolationKind.Value(f"VIOLATION_KIND_{v.kind.value}"), message=v.message,
                        at_unix_ms=int(recorded.at * 1000))


def sandbox_proto(record: SandboxRecord) -> pb.Sandbox:
    handle = record.handle
    return pb.Sandbox(
        sandbox_id=handle.id, created_unix_ms=int(handle.created_at * 1000),
        expires_unix_ms=int(handle.expires_at * 1000), from_warm_pool=handle.from_warm_pool,
        limits=limits_proto(handle.spec.limits), network=handle.spec.network,
        violations=[violation_proto(v) for v in record.violations], exec_count=record.exec_count,
        labels=dict(handle.spec.labels))


def exec_result_proto(result: ExecResult, now: float | None = None) -> pb.ExecResult:
    """`exit_code` is -N when signal N ended the program (the proto's convention; the driver's is 128+N)."""
    at = time.time() if now is None else now
    signal = result.signal or 0
    return pb.ExecResult(
        exit_code=-signal if signal else result.exit_code, signal=signal,
        stdout=result.stdout, stderr=result.stderr,
        stdout_truncated=result.stdout_truncated, stderr_truncated=result.stderr_truncated,
        duration_s=result.duration_s, cpu_s=result.cpu_s, max_rss_bytes=result.max_rss_bytes,
        violations=[violation_proto(RecordedViolation(v, at)) for v in result.violations])

