"""Configuration of the verifier service."""

from __future__ import annotations

from pydantic import Field

from rlfleet.common.config import RedisConfig, ServiceConfig, StrictModel


class ScoringSection(StrictModel):
    """Reward shaping shared by every verifier kind (rlfleet.verifier.kinds.ScoringConfig)."""

    pass_reward: float = Field(1.0, description="reward of a passed episode")
    fail_reward: float = Field(0.0, description="reward of a failed episode")
    invalid_tool_call_penalty: float = Field(0.05, ge=0, description="subtracted per invalid tool call")
    max_invalid_tool_call_penalty: float = Field(0.2, ge=0, description="cap of the invalid-call penalty")
    safety_violation_penalty: float = Field(0.2, ge=0,
                                            description="subtracted when the sandbox saw a safety violation")
    safety_violation_kinds: list[str] = Field(["network", "filesystem", "processes"],
                                              description="sandbox violation kinds that fail an episode")


class TestSandboxSection(StrictModel):
    """The sandbox hidden tests run in (a fresh one per run, never the policy's)."""

    __test__ = False

    memory_bytes: int = Field(512 << 20, ge=32 << 20, description="memory of the test run")
    max_processes: int = Field(64, ge=1, description="processes and threads of the test run")
    max_output_bytes: int = Field(1 << 20, ge=1024, description="test output kept, per stream")
    max_solution_bytes: int = Field(1 << 20, ge=1,
                                    description="largest candidate file copied from the policy's sandbox")


class VerifierConfig(ServiceConfig):
    """Verifier: scores episodes; rewards with structured failure reasons."""

    redis: RedisConfig = Field(default_factory=RedisConfig)
    sandbox_address: str = Field("", description="host:port of the sandbox manager (violations, files, "
                                 "hidden tests)")
    session_address: str = Field("", description="host:port of the session server (episodes by session_id)")
    suites_dir: str = Field("", description="directory of task suites (*.jsonl, searched recursively) with "
                            "their hidden answers/tests")
    tokenizer_path: str = Field("", description="directory with the policy's tokenizer.json, to decode "
                                "session tokens")
    peer_timeout_s: float = Field(30.0, gt=0, description="deadline of one call to the session server or "
                                  "sandbox manager")
    max_audit_episodes: int = Field(500, ge=1, description="labelled episodes one Audit call may carry "
                                    "(each may run hidden tests in a sandbox)")
    parallel_tests: int = Field(32, ge=1, description="hidden-test runs at once (each a thread waiting on "
                                "its sandbox); asyncio's default pool would allow cores + 4, which queued "
                                "verifications at a rollout concurrency of 16 (bench/code_episodes.py)")
    scoring: ScoringSection = Field(default_factory=ScoringSection)
    test_sandbox: TestSandboxSection = Field(default_factory=TestSandboxSection)
