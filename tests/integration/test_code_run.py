"""The coding agent through real sandboxes: repo episodes (the scripted ideal policy and a snooping one)
and a short `rlfleet run` on the repo suite with `tool_runtime = "sandbox"`.

The hidden tests run in a sandbox of the verifier's own: the episode's workspace, its writable places
and every process its sandbox shows never carry them, which a policy that goes looking finds out.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlfleet.common.testing import unique_run_id
from rlfleet.envkit.sdk import AgentLoop, Clients, EpisodeSpec
from rlfleet.envkit.sdk.environment import RepoEnvironment
from rlfleet.envkit.submit import write_for_verifier
from rlfleet.envkit.suites import repo
from rlfleet.envkit.tasks import task_message
from rlfleet.envkit.testing import LaunchedPlatform, build_tokenizer, start_scripted_engine

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RLFLEET = str(Path(sys.executable).parent / "rlfleet")


class Recording(RepoEnvironment):
    """The repo environment, keeping every observation it returns."""

    def __init__(self, seen: list[str]) -> None:
        self.seen = seen

    async def run_tool(self, sandbox, call):
        result = await super().run_tool(sandbox, call)
        self.seen.append(result.observation)
        return result


def scripted(task, script: str, task_id: str):
    user = task.messages[1].model_copy(update={"content": f"{task.messages[1].content} [script: {script}]"})
    return task.model_copy(update={"task_id": task_id, "messages": (task.messages[0], user)})


async def test_repo_episodes_fix_the_bug_through_sandboxed_tools_and_never_see_the_hidden_tests(tmp_path):
    tokenizer = build_tokenizer(tmp_path / "tokenizer")
    engine, url = start_scripted_engine(tokenizer, tmp_path)
    platform = LaunchedPlatform(tmp_path / "run", unique_run_id("code"), tokenizer, engine_url=url)
    try:
        platform.up()
        info = platform.info
        base = repo.generate_tasks("train", 2, seed=11, difficulty=1)
        ideal = scripted(base[0], "read, fix, test, done", "itest-repo-ideal")
        # Snoops before anything changed and again after the fix (four calls: the level's limit), then
        # answers.
        snoop = scripted(base[1], "snoop, read, fix, snoop, done", "itest-repo-snoop")
        snoop = snoop.model_copy(update={"limits": snoop.limits.model_copy(update={"max_new_tokens": 400})})
        unfixed = scripted(base[0], "read, test, done", "itest-repo-unfixed")
        write_for_verifier([ideal, snoop, unfixed], info.suites_dir)
        seen: list[str] = []
        async with Clients.connect(session=info.session_address, sandbox=info.sandbox_address,
                                   verifier=info.verifier_address) as services:
            loop = AgentLoop(services, environments=lambda suite: Recording(seen))
            runs = {task.task_id: await loop.run(EpisodeSpec(task=task_message(task, info.run_id),
                                                             session_id=f"{task.task_id}-s0"))
                    for task in (ideal, snoop, unfixed)}
    finally:
        platform.down()
        engine.stop()
    good = runs["itest-repo-ideal"]
    assert (good.end, good.tool_calls, good.invalid_calls, good.passed) == ("answer", 3, 0, True), good
    assert good.tools == {"read_file": 1, "edit_file": 1, "run": 1}
    assert good.sandbox_s > 0 and good.verify_s > 0 and good.tool_wait_s > 0
    assert f"edited {ideal.metadata['target_file']}" in seen and "all tests passed" in seen
    assert runs["itest-repo-snoop"].passed, runs["itest-repo-snoop"]
    snoops = [text for text in seen if "hidden tests:" in text]
    assert snoops == ["hidden tests: none"] * 2, seen
    assert not any("RESULT passed" in text or "CASES" in text for text in seen)
    bad = runs["itest-repo-unfixed"]
    # a failing test is no invalid call
    assert not bad.passed and "WRONG_ANSWER" in bad.reasons and bad.invalid_calls == 0


CONFIG = """
run_id = "itest-code"
suite = "repo"
start_timeout_s = 300
group_size = 4
[model]
hidden_size = 64
num_hidden_layers = 2
[warm_start]
demonstrations = 200
epochs = 2
lr = 3e-3
[rollout]
concurrency = 8
tool_runtime = "sandbox"
max_staleness = 2
[trainer]
groups_per_step = 2
[eval]
heldout = 8
regression = 0
concurrency = 8
[gate]
every_versions = 2
[budget]
max_steps = 3
max_minutes = 1.5
"""


@pytest.mark.timeout(900)  # a model build, a warm start and a run on a shared machine
def test_a_short_code_run_through_real_sandboxes_trains_and_advances_versions(tmp_path):
    config = tmp_path / "code.toml"
    config.write_text(CONFIG)
    # As `make run-code` runs it: no run directory named, so `runs/<run_id>` below the working directory
    # (the controller is handed that directory, not the config's empty run_dir).
    run_dir = tmp_path / "runs" / "itest-code"
    result = subprocess.run([RLFLEET, "run", str(config),
                             "--model-cache-dir", str(tmp_path / "cache")],
                            capture_output=True, text=True, timeout=880, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_version"] >= 2, summary  # trajectories were trained on: versions advanced
    assert summary["trajectories"]["train"] >= 2 * 2 * 4
    episodes = summary["episodes"]
    assert episodes["episodes"] >= 16 and episodes["phase_s_per_episode"]["sandbox_create_destroy"] > 0
    assert episodes["phase_s_per_episode"]["verification"] > 0
    assert sum(b["episodes"] for b in episodes["verifier_reasons_over_time"]) == episodes["episodes"]
    assert set(episodes["tool_calls_by_tool"]) <= set(repo.TOOL_NAMES)
    assert summary["baseline_vs_rl"]["baseline"]["episodes"] == 8
    assert "tool calls per episode" in result.stdout and "failure reasons" in result.stdout
