"""The verifier: finds the task, reads the episode itself, scores it with the task's kind, stores the verdict.

The environment client names *what* to score (a session, a sandbox, a task); it never supplies the
reward, and with a session it does not supply the answer either: the answer, the tool calls and
their failures are read from the session's own tokens, violations from the sandbox manager's
record, and the candidate's files from the policy's sandbox. Hidden tests run in a fresh sandbox of
their own (`peers.SandboxPeer.run_tests`), never in the policy's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.session.v1 import session_pb2
from rlfleet.common.errors import InvalidArgument
from rlfleet.common.verdicts import store_verdict
from rlfleet.verifier.kinds import (
    AuditReport,
    Episode,
    KindRegistry,
    LabelledEpisode,
    ScoringConfig,
    TestRunRequest,
    TestRunResult,
    audit,
    default_kinds,
)
from rlfleet.verifier.metrics import VerifierMetrics
from rlfleet.verifier.peers import SandboxPeer, SessionPeer, StoredSessions
from rlfleet.verifier.protos import verdict_proto
from rlfleet.verifier.suites import SuiteCatalog
from rlfleet.verifier.transcript import (
    SessionDecoder,
    episode_from_turns,
    session_truncated,
    turns_from_session,
    turns_from_text,
)


@dataclass(frozen=True)
class VerifyInput:
    session_id: str = ""
    suite: str = ""
    task_id: str = ""
    sandbox_id: str = ""
    final_answer: str = ""
    files: Mapping[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class LabelledInput:
    """One human-labelled episode for an audit: an answer, candidate files and/or a transcript."""

    suite: str
    task_id: str
    human_passed: bool
    final_answer: str = ""
    files: Mapping[str, bytes | str] = field(default_factory=dict)
    transcript: str = ""
    episode_id: str = ""


class Verifier:
    def __init__(self, catalog: SuiteCatalog, *, sessions: SessionPeer | StoredSessions,
                 sandboxes: SandboxPeer, decoder: SessionDecoder,
                 scoring: ScoringConfig, redis: Any = None, run_id: str = "",
                 metrics: VerifierMetrics | None = None, audit_workers: int = 4,
                 parallel_tests: int = 32) -> None:
        self.audit_workers = audit_workers
        # Hidden-test runs wait on their sandbox in threads of their own: as many at once as episodes
        # verify at once, not asyncio's default pool (cores + 4).
        self.test_threads = ThreadPoolExecutor(parallel_tests, thread_name_prefix="hidden-tests")
        self.catalog = catalog
        self.sessions = sessions
        self.sandboxes = sandboxes
        self.decoder = decoder
        self.scoring = scoring
        self.redis = redis
        self.run_id = run_id
        self.metrics = metrics

    async def verify(self, request: VerifyInput) -> common_pb2.Verdict:
        started = time.monotonic()
        check(request)
        session = await self.sessions.session(request.session_id) if request.session_id else None
        task_id = task_id_of(request, session)
        task = await self.catalog.task(request.suite, task_id)
        episode = await self.episode(request, session, task)
        verdict = await self.score(task, episode, request.session_id)
        record = verdict_proto(verdict, session_id=request.session_id, task_id=task_id,
                               verify_s=time.monotonic() - started)
        if request.session_id and self.redis is not None:
            await store_verdict(self.redis, self.run_id, record)
        if self.metrics is not None:
            self.metrics.record(record)
        return record

    async def audit(self, items: Sequence[LabelledInput]) -> AuditReport:
        labelled = []
        for item in items:
            task = await self.catalog.task(item.suite, item.task_id)
            episode = episode_from_turns(turns_from_text(item.transcript), task)
            episode.answer = item.final_answer or None  # used only when the transcript has no assistant turn
            episode.files = solution_files(task, item.files)
            labelled.append(LabelledEpisode(task, episode, item.human_passed, item.episode_id))
        return await asyncio.to_thread(audit, self.kinds(""), labelled, self.audit_workers)

    # -- parts -------------------------------------------------------------------------------

    async def episode(self, request: VerifyInput, session: session_pb2.Session | None,
                      task: Mapping[str, Any]) -> Episode:
        if session is not None:
            turns = turns_from_session(session, self.decoder)
            episode = episode_from_turns(turns, task, truncated=session_truncated(session))
        else:
            episode = Episode(answer=request.final_answer or None)
        if request.sandbox_id:
            episode.violations = await self.sandboxes.violations(request.sandbox_id)
            if wanted := solution_paths(task):
                episode.files = await self.sandboxes.read_files(request.sandbox_id, wanted)
        else:
            episode.files = solution_files(task, request.files)
        return episode

    async def score(self, task: Mapping[str, Any], episode: Episode, session_id: str):
        """Answer kinds are quick and pure; `unit_tests` waits on a sandbox, so it scores in a
        worker thread."""
        kinds = self.kinds(session_id)
        if solution_paths(task):
            return await asyncio.get_running_loop().run_in_executor(self.test_threads, kinds.score,
                                                                    task, episode)
        return kinds.score(task, episode)

    def kinds(self, session_id: str) -> KindRegistry:
        """Every kind; `unit_tests` runs its hidden tests through the sandbox manager (FAILED_PRECONDITION
        without one: the suite catalog normally rejects such tasks at load already)."""
        loop = asyncio.get_running_loop()

        def run_tests(request: TestRunRequest) -> TestRunResult:  # called by the kind, in a worker thread
            future = asyncio.run_coroutine_threadsafe(self.sandboxes.run_tests(request, session_id), loop)
            return future.result()

        return default_kinds(run_tests, self.scoring)


def check(request: VerifyInput) -> None:
    if request.session_id and request.final_answer:
        raise InvalidArgument("with a session_id the answer is read from the session's tokens: "
                              "do not send final_answer too")
    if not (request.session_id or request.final_answer or request.files or request.sandbox_id):
        raise InvalidArgument("nothing to verify: give a session_id, or a final_answer and/or files")
    if not request.session_id and not request.task_id:
        raise InvalidArgument("task_id is required without a session_id")


def task_id_of(request: VerifyInput, session: session_pb2.Session | None) -> str:
    if session is None or not session.task_id:
        if not request.task_id:
            raise InvalidArgument("task_id is required: the session does not name its task")
        return request.task_id
    if request.task_id and request.task_id != session.task_id:
        raise InvalidArgument(f"task_id {request.task_id!r} is not the session's task ({session.task_id!r})")
    return session.task_id


def solution_paths(task: Mapping[str, Any]) -> list[str]:
    spec = task["verifier"]
    return list(spec.get("solution_files") or ()) if spec.get("kind") == "unit_tests" else []


def solution_files(task: Mapping[str, Any], files: Mapping[str, bytes | str]) -> dict[str, bytes | str]:
    """Only the files the task declares reach its tests (nothing else a client sends)."""
    wanted = solution_paths(task)
    return {path: content for path, content in files.items() if path in wanted}
