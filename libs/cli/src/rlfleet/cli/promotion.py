"""The promotion gate as the loop runs it (its statistics are gate.py): every `gate.every_versions`
versions the version the canary pool serves (the rollouts' policy) is the candidate. It is pinned on
the candidate pool, where it stays while it is evaluated on the held-out split (paired with the
accepted version, stopping at the first slice that already refuses) and the regression set, so
the rollouts go on with newer versions meanwhile; the verifier is audited, and the broker promotes
the candidate or not. A platform without candidate engines evaluates on the canary pool, which the
broker then holds still for `every_versions` versions (rlfleet.cli.run_config)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import grpc

from rlfleet.api.broker.v1 import broker_pb2, broker_pb2_grpc
from rlfleet.cli.gate import Decision, decide, interim, merge, slices
from rlfleet.cli.report import EvalResult, GateDecision
from rlfleet.cli.run_context import LoopContext, Stopped, rpc, wait_served
from rlfleet.cli.stop_checks import StopChecks

log = logging.getLogger(__name__)
# How long the candidate pool may take to serve a pinned version (a delta chain, or a restarted
# engine's full load) before the gate gives up on it and pins a newer one.
PIN_WAIT_S = 60.0


class Evaluate(Protocol):
    def __call__(self, tasks: Sequence[Any], version: int, split: str, label: str, pool: str,
                 keep: bool = True) -> Awaitable[EvalResult]: ...


class PromotionGate:
    def __init__(self, ctx: LoopContext, broker: broker_pb2_grpc.BrokerServiceStub, evaluate: Evaluate,
                 checks: StopChecks, save_state: Callable[[], Awaitable[None]],
                 heldout: Sequence[Any], regression: Sequence[Any]) -> None:
        self.ctx = ctx
        self.broker = broker
        self.evaluate = evaluate
        self.checks = checks
        self.save_state = save_state
        self.heldout, self.regression = heldout, regression

    def due(self, version: int) -> bool:
        gate = self.ctx.config.gate
        return gate.enabled and version - self.ctx.last_gated >= gate.every_versions

    async def follow_the_canary(self) -> None:
        """Async mode: gates each version the canary pool serves once it is due, until the stop."""
        if not self.ctx.config.gate.enabled:
            return
        while not self.ctx.stop.is_set():
            status = await rpc(self.broker.GetStatus, broker_pb2.GetStatusRequest())
            canary = [e.policy_version for e in status.engines if e.pool == "canary"]
            version = min(canary) if canary else 0
            if self.due(version):
                if not any(e.pool == "candidate" for e in status.engines):
                    await self.decide(version)
                elif await self._pin(version):
                    await self.decide(version, pool="candidate")
            await asyncio.sleep(1.0)

    async def _pin(self, version: int) -> bool:
        """Pins `version` on the candidate pool and waits until its engines serve it. False (the gate
        looks again a second later, at the canary's version then) when the broker cannot pin it yet
        (the canary's service of it not recorded yet) or the pool did not serve it in time."""
        try:
            await rpc(self.broker.PinCandidate, broker_pb2.PinCandidateRequest(
                version=version, reason="the promotion gate evaluates it"))
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            log.info("gate: version %d not pinned yet: %s", version, exc.details())
            return False
        # Pins only move forward (each gated version is newer), so "or newer" is this version.
        if await wait_served(self.broker, version, "candidate", timeout_s=PIN_WAIT_S, stop=self.ctx.stop):
            return True
        if not self.ctx.stop.is_set():
            self.ctx.say(f"gate: the candidate pool did not serve version {version} within "
                         f"{PIN_WAIT_S:.0f} s; the gate takes the canary's version again")
        return False

    async def decide(self, version: int, pool: str = "canary") -> None:
        """Evaluates `version`, served by `pool`, and promotes it or not."""
        ctx = self.ctx
        assert ctx.accepted_eval is not None  # the baseline, evaluated before the loop
        previous, ctx.last_gated = ctx.last_gated, version
        try:
            candidate, decision = await ctx.unless_stopped(self._evaluate_candidate(version, pool))
            cand_reg = await ctx.unless_stopped(
                self.evaluate(self.regression, version, "regression", "candidate", pool)) \
                if self.regression and decision is None else None
        except Stopped:
            ctx.last_gated = previous  # not decided: a resumed run gates this version again
            ctx.say(f"gate: evaluation of version {version} abandoned (stopping)")
            return
        decision = decision or decide(ctx.config.gate, candidate, ctx.accepted_eval, cand_reg,
                                      ctx.accepted_regression)
        if (decision.accepted
                and not await self.checks.verifier_trusted(f"before promoting version {version}")):
            decision.accepted = False
            decision.reasons.append("not promoted: the verifier failed its audit")
        ctx.record.gate.append(GateDecision(version, decision.accepted, decision.reasons,
                                            ctx.clock.elapsed(), decision.check_dicts(), decision.tasks,
                                            decision.early))
        verdict = "accepted" if decision.accepted else "refused"
        ctx.say(f"gate: version {version} {verdict}:\n  " + "\n  ".join(decision.reasons))
        if decision.accepted:
            await rpc(self.broker.Promote,
                      broker_pb2.PromoteRequest(version=version, reason="; ".join(decision.reasons)))
            ctx.accepted_eval, ctx.accepted_regression = candidate, cand_reg
            ctx.record.accepted_version = version
        self.checks.account_long_tail()
        await self.save_state()

    async def _evaluate_candidate(self, version: int, pool: str) -> tuple[EvalResult, Decision | None]:
        """The candidate on the held-out set in the gate's slices, paired with the accepted version's
        kept per-task results (same tasks, same seeds: see `eval.seeded`); stops at the first slice
        after which the gate can already refuse. Returns the evaluation and that refusal, or None."""
        ctx = self.ctx
        assert ctx.accepted_eval is not None  # the baseline, evaluated before the loop
        parts: list[EvalResult] = []
        early = None
        for start, end in slices(len(self.heldout), ctx.config.gate.looks):
            parts.append(await self.evaluate(self.heldout[start:end], version, "heldout", "candidate",
                                             pool, keep=False))
            if end < len(self.heldout):
                early = interim(ctx.config.gate, merge(parts), ctx.accepted_eval)
                if early:
                    break
        result = merge(parts)
        ctx.record.evals.append(result)
        return result, early
