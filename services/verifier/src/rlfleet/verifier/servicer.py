"""VerifierService over gRPC: requests to the verifier, results to protos. Errors map at the interceptor."""

from __future__ import annotations

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from rlfleet.common import security
from rlfleet.common.errors import InvalidArgument, NotFound
from rlfleet.common.verdicts import load_verdict
from rlfleet.verifier.protos import audit_report_proto
from rlfleet.verifier.verifier import LabelledInput, Verifier, VerifyInput


class VerifierServicer(verifier_pb2_grpc.VerifierServiceServicer):
    def __init__(self, verifier: Verifier, max_audit_episodes: int = 500) -> None:
        self.verifier = verifier
        self.max_audit_episodes = max_audit_episodes

    async def Verify(self, request: verifier_pb2.VerifyRequest, context) -> common_pb2.Verdict:
        return await self.verifier.verify(VerifyInput(
            session_id=request.session_id, suite=request.suite, task_id=request.task_id,
            sandbox_id=request.sandbox_id, final_answer=request.final_answer, files=dict(request.files)))

    async def GetVerdict(self, request: verifier_pb2.GetVerdictRequest, context) -> common_pb2.Verdict:
        if not request.session_id:
            raise InvalidArgument("session_id is required")
        if not security.caller().trusted:  # a client reads only its own sessions' verdicts
            await self.verifier.sessions.session(request.session_id)
        verdict = await load_verdict(self.verifier.redis, self.verifier.run_id, request.session_id)
        if verdict is None:
            raise NotFound(f"no verdict is stored for session {request.session_id!r}")
        return verdict

    async def Audit(self, request: verifier_pb2.AuditRequest, context) -> verifier_pb2.AuditReport:
        if not request.episodes:
            raise InvalidArgument("an audit needs at least one labelled episode", field="episodes")
        if len(request.episodes) > self.max_audit_episodes:
            raise InvalidArgument(
                f"{len(request.episodes)} labelled episodes in one Audit call, "
                f"at most {self.max_audit_episodes} (max_audit_episodes): split the set", field="episodes",
                count=len(request.episodes), limit=self.max_audit_episodes)
        items = [LabelledInput(suite=e.suite, task_id=e.task_id, human_passed=e.human_passed,
                               final_answer=e.final_answer, files=dict(e.files), transcript=e.transcript,
                               episode_id=e.episode_id) for e in request.episodes]
        return audit_report_proto(await self.verifier.audit(items))
