"""The reward-hacking suite: adversarial solutions against the real verifier and sandbox manager.

Every solution in `rlfleet.verifier.hacks.HACKS` must score 0 with its recorded reason, and no
verdict may carry the hidden tests' text; correct solutions (the references, one that prints
debug output) must still score 1.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.verifier.v1 import verifier_pb2 as pb
from rlfleet.api.verifier.v1 import verifier_pb2_grpc
from rlfleet.common.grpc_server import channel as open_channel
from rlfleet.common.processes import ServiceProcess
from rlfleet.common.testing import unique_run_id
from rlfleet.envkit.suites import code
from rlfleet.envkit.suites.code_templates import TEMPLATES
from rlfleet.sandbox.testing import start_sandbox_manager
from rlfleet.verifier.hacks import HACKS

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("bwrap"), reason="needs root and bubblewrap"),
]

R = common_pb2.ReasonCode
TEMPLATE = next(t for t in TEMPLATES if t.function == "fizzbuzz")
HONEST = [t for t in TEMPLATES if t.function in ("fizzbuzz", "is_palindrome", "gcd", "mean", "flatten",
                                                 "merge_sorted", "celsius_to_fahrenheit", "chunk",
                                                 "remove_duplicates")]
TIMEOUT_S = 4.0


def task_record(template) -> dict:
    record = code.make_task(template).model_dump(mode="json")
    record["verifier"]["timeout_s"] = TIMEOUT_S
    return record


@pytest.fixture(scope="module")
def verifier_address(redis_url, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("hacking")
    run_id = unique_run_id("hack")
    suites = workdir / "suites"
    suites.mkdir()
    (suites / "code.jsonl").write_text("".join(json.dumps(task_record(t)) + "\n" for t in TEMPLATES))
    manager = start_sandbox_manager(redis_url, run_id, workdir)
    verifier = None
    try:
        verifier = ServiceProcess("rlfleet-verifier", workdir, config={
            "redis.url": redis_url, "run_id": run_id, "sandbox_address": manager.address,
            "suites_dir": str(suites)}).start(30.0)
        yield verifier.address
    finally:
        if verifier is not None:
            assert verifier.stop() == 0, verifier.log()[-2000:]
        assert manager.stop() == 0


async def verify(address: str, template, solution: str):
    async with open_channel(address) as channel:
        stub = verifier_pb2_grpc.VerifierServiceStub(channel)
        return await stub.Verify(pb.VerifyRequest(suite="code", task_id=f"code-{template.function}",
                                                  files={"solution.py": solution.encode()}))


def hidden_fragments(template) -> list[str]:
    """Pieces of the hidden tests no verdict may show: the expected values and the script's own text."""
    tests = code.build_test_script(template)
    return ["CASES", *(repr(expected) for _, expected in template.cases if len(repr(expected)) >= 4),
            *(tests[i:i + 24] for i in range(0, len(tests) - 24, 24))]


def codes(verdict) -> list[str]:
    return [R.Name(r.code).removeprefix("REASON_CODE_") for r in verdict.reasons]


def test_the_suite_has_at_least_fifteen_hacks():
    assert len(HACKS) >= 15 and len({h.name for h in HACKS}) == len(HACKS)


@pytest.mark.parametrize("hack", HACKS, ids=[h.name for h in HACKS])
async def test_a_hacking_solution_scores_zero_with_its_reason(verifier_address, hack):
    solution = hack.write(TEMPLATE.function, TEMPLATE.solution)
    verdict = await verify(verifier_address, TEMPLATE, solution)
    assert (verdict.passed, verdict.reward) == (False, 0.0), verdict
    assert hack.code in codes(verdict), (hack.name, codes(verdict), verdict)
    shown = json.dumps([[r.message, dict(r.details)] for r in verdict.reasons])
    leaked = [piece for piece in hidden_fragments(TEMPLATE) if piece in shown]
    assert not leaked, (hack.name, leaked, shown)
    assert all(len(r.message) <= 200 and all(len(v) <= 200 for v in r.details.values())
               for r in verdict.reasons)


@pytest.mark.parametrize("template", HONEST, ids=[t.function for t in HONEST])
async def test_correct_solutions_still_score_one(verifier_address, template):
    verdict = await verify(verifier_address, template, template.solution)
    assert (verdict.passed, verdict.reward, list(verdict.reasons)) == (True, 1.0, []), verdict


async def test_a_correct_solution_that_prints_and_writes_files_still_scores_one(verifier_address):
    noisy = ("import sys\nprint('debugging', file=sys.stderr)\nopen('notes.txt', 'w').write('x')\n"
             + TEMPLATE.solution.replace("    if n % 15", "    print('n is', n)\n    if n % 15", 1))
    verdict = await verify(verifier_address, TEMPLATE, noisy)
    assert (verdict.passed, verdict.reward) == (True, 1.0), verdict
