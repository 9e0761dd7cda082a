"""Running one task as a group of G samples, idempotently across redeliveries.

Identity is a function of the stream, not of the worker: `group_id = f"{task_id}-{sequence}"` and
sample i's session is `f"{group_id}-{tag}-s{i}"`, where `tag` is a keyed digest of the group (64 bits
of HMAC-SHA256 under the run's secret, or the client's own token): other clients cannot predict a
worker's session ids, so cannot take one first, while every worker of the run (same key) derives the
same ids for a redelivered task. On a redelivery (delivery d > 1) each sample is looked
up first: a sample whose session (under any earlier ID) is CLOSED is already published and skipped;
one still OPEN belonged to a worker that is gone and is aborted; the sample then runs again as
`f"{group_id}-s{i}-r{d}"`, an ID no earlier delivery used, so two deliveries never drive one session.

A sample a service outage stopped (a peer down or restarting: nothing about the task) runs again
inside the same delivery once the services answer, as outage attempt k: `f"...-o{k}"` (at most
`MAX_OUTAGE_ATTEMPTS`), so an outage does not use up the task's deliveries; a later delivery looks
those IDs up too.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import Callable
from dataclasses import dataclass, field

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.session.v1 import session_pb2
from rlfleet.common import security
from rlfleet.envkit.sdk.clients import SessionClient
from rlfleet.envkit.sdk.episode import AgentLoop, EpisodeSpec
from rlfleet.envkit.sdk.errors import Superseded
from rlfleet.envkit.sdk.summary import EpisodeSummary
from rlfleet.envkit.worker_config import SamplingDefaults

PUBLISHED = (common_pb2.TRAJECTORY_STATUS_COMPLETED, common_pb2.TRAJECTORY_STATUS_TRUNCATED,
             common_pb2.TRAJECTORY_STATUS_FAILED)


def group_id_of(task_id: str, sequence: int) -> str:
    return f"{task_id}-{sequence}"


MAX_OUTAGE_ATTEMPTS = 16  # re-runs of one sample inside one delivery after service outages


def session_id_key(credentials: security.Credentials | None = None) -> bytes:
    """The key session ids are derived under: from the run's token key where this process has the
    run's secrets (every such worker shares it), else from the client's own token."""
    creds = credentials or security.local_credentials()
    if creds.book is not None:
        return hmac.new(creds.book.key, b"rlfleet session ids", hashlib.sha256).digest()
    return hashlib.sha256(creds.token.encode()).digest()


def session_id_of(group_id: str, sample_index: int, delivery: int = 1, outage: int = 0,
                  key: bytes = b"") -> str:
    tag = f"-{hmac.new(key, group_id.encode(), hashlib.sha256).hexdigest()[:16]}" if key else ""
    base = f"{group_id}{tag}-s{sample_index}"
    base = base if delivery <= 1 else f"{base}-r{delivery}"
    return f"{base}-o{outage}" if outage else base


@dataclass
class GroupResult:
    group_id: str
    episodes: list[EpisodeSummary] = field(default_factory=list)
    skipped: int = 0  # samples an earlier delivery had published already
    unfinished: list[str] = field(default_factory=list)  # "s<i>: why" for samples not published
    superseded: bool = False  # a newer delivery took the group over
    platform_failures: int = 0  # unfinished samples a service outage stopped (not the task)

    @property
    def complete(self) -> bool:
        return not self.unfinished and not self.superseded

    @property
    def platform_outage(self) -> bool:
        """Unfinished only because services were down or full: running it again later is no
        judgement on the task, so it must not use up the task's deliveries."""
        return bool(self.unfinished) and self.platform_failures == len(self.unfinished)


class GroupRunner:
    def __init__(self, loop: AgentLoop, sessions: SessionClient, slots: asyncio.Semaphore, *,
                 sampling: SamplingDefaults, max_total_tokens: int = 0, id_key: bytes = b"") -> None:
        self.id_key = id_key  # session_id_key(): empty only in unit tests of the plan
        self.loop = loop
        self.sessions = sessions
        self.slots = slots
        self.sampling = sampling
        self.max_total_tokens = max_total_tokens

    async def run(self, task: common_pb2.Task, sequence: int, delivery: int,
                  on_episode: Callable[[EpisodeSummary], None] = lambda summary: None,
                  outage: int = 0) -> GroupResult:
        """Runs the samples not published yet, concurrently (bounded by the shared slots);
        `on_episode` sees each summary as soon as its episode ends. `outage` > 0 is a re-run inside
        the same delivery after a service outage stopped some samples."""
        result = GroupResult(group_id_of(task.task_id, sequence))
        size = task.group_size
        plans = await asyncio.gather(*(self._plan(result.group_id, i, delivery, outage) for i in range(size)))
        result.skipped = sum(1 for session_id in plans if session_id is None)
        try:
            async with asyncio.TaskGroup() as samples:
                running = [samples.create_task(self._sample(task, result.group_id, i, session_id, on_episode))
                           for i, session_id in enumerate(plans) if session_id is not None]
        except* Superseded:
            result.superseded = True
        if result.superseded:
            return result
        for summary in (t.result() for t in running):
            result.episodes.append(summary)
            if summary.status not in PUBLISHED:
                result.unfinished.append(f"s{summary.sample_index}: {summary.error or summary.end}")
                result.platform_failures += summary.platform_failure
        return result

    async def _plan(self, group_id: str, index: int, delivery: int, outage: int = 0) -> str | None:
        """The session ID sample `index` runs under in this attempt, or None when it is published."""
        if delivery <= 1 and outage == 0:
            return session_id_of(group_id, index, key=self.id_key)
        earlier = [(d, k) for d in range(1, delivery) for k in range(MAX_OUTAGE_ATTEMPTS + 1)]
        earlier += [(delivery, k) for k in range(outage)]
        for d, k in earlier:
            session_id = session_id_of(group_id, index, d, k, key=self.id_key)
            session = await self.sessions.get(session_id)
            if session is None:
                continue
            if session.state == session_pb2.SESSION_STATE_CLOSED:
                # Idempotent: publishes it if the first close could not. Closed as whatever it was
                # (UNSPECIFIED): a sample closed TRUNCATED or FAILED is as published as a COMPLETED
                # one, and asking for COMPLETED was refused, failing every redelivery of its group.
                await self.sessions.close(session_id, common_pb2.TRAJECTORY_STATUS_UNSPECIFIED)
                return None
            if session.state == session_pb2.SESSION_STATE_OPEN:
                await self.sessions.abort(session_id,
                                          f"task redelivered (delivery {delivery}, attempt {outage}); "
                                                      "its worker is gone")
        return session_id_of(group_id, index, delivery, outage, key=self.id_key)

    async def _sample(self, task: common_pb2.Task, group_id: str, index: int, session_id: str,
                      on_episode: Callable[[EpisodeSummary], None]) -> EpisodeSummary:
        async with self.slots:
            spec = EpisodeSpec(task=task, session_id=session_id, group_id=group_id, sample_index=index,
                               group_size=task.group_size,
                               sampling=self.sampling_for(task, session_id, index),
                               max_total_tokens=self.max_total_tokens)
            summary = await self.loop.run(spec)
        on_episode(summary)
        return summary

    def sampling_for(self, task: common_pb2.Task, session_id: str, index: int) -> common_pb2.SamplingParams:
        """The task's sampling, its unset fields filled from the worker's defaults; a
        distinct seed per sample."""
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(task.sampling)
        defaults = self.sampling
        sampling.max_new_tokens = sampling.max_new_tokens or defaults.max_new_tokens
        if not sampling.HasField("temperature"):
            sampling.temperature = defaults.temperature
        if not sampling.HasField("top_p"):
            sampling.top_p = defaults.top_p
        if not sampling.HasField("top_k"):
            sampling.top_k = defaults.top_k
        if sampling.HasField("seed"):
            sampling.seed = (sampling.seed + index) % 2**63  # the same seed would give G identical samples
        elif defaults.seed is not None:
            digest = hashlib.sha256(f"{defaults.seed}:{session_id}".encode()).digest()
            sampling.seed = int.from_bytes(digest[:8], "big") % 2**63
        return sampling
