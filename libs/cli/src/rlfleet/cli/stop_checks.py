"""The stop rules as the loop applies them (the rules themselves are stop_rules.py): the verifier
audited before the loop and before every promotion, and the long tail accounted at every gate."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Collection
from dataclasses import asdict

from rlfleet.api.verifier.v1 import verifier_pb2, verifier_pb2_grpc
from rlfleet.cli.run_context import LoopContext, rpc
from rlfleet.cli.stop_rules import audit_result, audit_subset, long_tail
from rlfleet.common.errors import StartupError
from rlfleet.envkit.submit import SubmitError, load_tasks, write_for_verifier


class StopChecks:
    def __init__(self, ctx: LoopContext, verifier: verifier_pb2_grpc.VerifierServiceStub,
                 kinds: Collection[str] = ()) -> None:
        """`kinds`: the verifier kinds the run's tasks are scored with (`audit.scope = "run"`)."""
        self.ctx = ctx
        self.verifier = verifier
        self.kinds = frozenset(kinds)
        self.audit_labels: list[dict] = []  # the labelled episodes each verifier audit sends

    def audit_set(self) -> list[dict]:
        """The labelled audit set (written once into the run directory by the verifier's own
        command), its tasks added to the suites the run's verifier reads; the subset each audit sends."""
        c = self.ctx.config.audit
        where = self.ctx.run_dir / "audit_set"
        labels = where / "labels.jsonl"
        if not labels.exists():
            subprocess.run([sys.executable, "-m", "rlfleet.verifier.audit_set", "write", str(where),
                            "--seed", str(c.seed)], check=True, capture_output=True, timeout=300)
        try:
            tasks = [t for suite in sorted((where / "suites").glob("*.jsonl"))
                     for t in load_tasks(str(suite))]
            write_for_verifier(tasks, self.ctx.run_dir / "suites")
        except SubmitError as exc:
            raise StartupError(f"the verifier audit set does not fit this run's suites: {exc}") from None
        labelled = [json.loads(line) for line in labels.read_text().splitlines() if line.strip()]
        if c.scope == "run":
            kind = {(t.suite, t.task_id): t.verifier.kind for t in tasks}
            own = [e for e in labelled if kind.get((e.get("suite", ""), e["task_id"])) in self.kinds]
            labelled = own or labelled
        return audit_subset(labelled, c.episodes, c.seed)

    async def verifier_trusted(self, when: str) -> bool:
        """Audits the run's verifier (`audit.*`); when a rate passes its threshold the run stops,
        with the reason on screen, in the report and in the run state."""
        ctx, c = self.ctx, self.ctx.config.audit
        if not c.enabled:
            return True
        if not self.audit_labels:
            self.audit_labels = await asyncio.to_thread(self.audit_set)
        request = verifier_pb2.AuditRequest(episodes=[verifier_pb2.LabelledEpisode(
            suite=e.get("suite", ""), task_id=e["task_id"], final_answer=e.get("final_answer", ""),
            files={k: v.encode() for k, v in e.get("files", {}).items()}, transcript=e.get("transcript", ""),
            human_passed=e["human_passed"], episode_id=e.get("episode_id", "")) for e in self.audit_labels])
        report = await rpc(self.verifier.Audit, request, timeout_s=c.timeout_s, within_s=2 * c.timeout_s)
        result = audit_result(report, when, c)
        ctx.record.audits.append(asdict(result))
        ctx.say(result.line())
        if not result.breaches:
            return True
        ctx.record.stop_rule = f"verifier audit {when}: " + "; ".join(result.breaches)
        ctx.interrupted = f"stop rule: {ctx.record.stop_rule}"
        ctx.say(f"stop rule: {ctx.record.stop_rule}; stopping the run (disagreements: "
                f"{', '.join(result.disagreements) or '-'})")
        ctx.stop.set()
        return False

    def account_long_tail(self) -> None:
        ctx, c = self.ctx, self.ctx.config.long_tail
        record = ctx.record
        baseline = next((e for e in record.evals if e.label == "baseline" and e.split == "heldout"), None)
        if not c.enabled or baseline is None or ctx.accepted_eval is None:
            return
        account = long_tail(record.trajectories, max_staleness=ctx.config.rollout.max_staleness,
                            eval_retried=sum(e.retried for e in record.evals),
                            gain=ctx.accepted_eval.success - baseline.success, config=c)
        # The trainer's own count of what it did not train, by reason, beside the driver's account.
        record.long_tail = account.as_dict() | {"trainer_dropped": dict(ctx.trainer_dropped)}
        if not account.fired or record.stop_rule:
            return
        record.stop_rule = account.message
        record.notes.append(f"stop rule: {account.message}")
        if c.action == "stop":
            ctx.say(f"stop rule: {account.message}; stopping the loop (long_tail.action = \"stop\")")
            ctx.stop.set()
        else:
            ctx.say(f"stop rule: {account.message} (reported only: long_tail.action = \"report\")")
