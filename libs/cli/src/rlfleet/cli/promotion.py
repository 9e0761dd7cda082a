"""The promotion gate as the loop runs it (its statistics are gate.py): every `gate.every_versions`
versions the canary's candidate is evaluated on the held-out split (paired with the accepted
version, stopping at the first slice that already refuses) and the regression set, the verifier is
audited, and the broker promotes the candidate or not."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from rlfleet.api.broker.v1 import broker_pb2, broker_pb2_grpc
from rlfleet.cli.gate import Decision, decide, interim, merge, slices
from rlfleet.cli.report import EvalResult, GateDecision
from rlfleet.cli.run_context import LoopContext, Stopped, rpc
from rlfleet.cli.stop_checks import StopChecks


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
                await self.decide(version)
            await asyncio.sleep(1.0)

    async def decide(self, version: int) -> None:
        ctx = self.ctx
        assert ctx.accepted_eval is not None  # the baseline, evaluated before the loop
        previous, ctx.last_gated = ctx.last_gated, version
        try:
            candidate, decision = await ctx.unless_stopped(self._evaluate_candidate(version))
            cand_reg = await ctx.unless_stopped(
                self.evaluate(self.regression, version, "regression", "candidate", "canary")) \
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

    async def _evaluate_candidate(self, version: int) -> tuple[EvalResult, Decision | None]:
        """The candidate on the held-out set in the gate's slices, paired with the accepted version's
        kept per-task results (same tasks, same seeds: see `eval.seeded`); stops at the first slice
        after which the gate can already refuse. Returns the evaluation and that refusal, or None."""
        ctx = self.ctx
        assert ctx.accepted_eval is not None  # the baseline, evaluated before the loop
        parts: list[EvalResult] = []
        early = None
        for start, end in slices(len(self.heldout), ctx.config.gate.looks):
            parts.append(await self.evaluate(self.heldout[start:end], version, "heldout", "candidate",
                                             "canary", keep=False))
            if end < len(self.heldout):
                early = interim(ctx.config.gate, merge(parts), ctx.accepted_eval)
                if early:
                    break
        result = merge(parts)
        ctx.record.evals.append(result)
        return result, early
