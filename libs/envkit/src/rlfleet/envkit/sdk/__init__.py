"""The environment SDK: clients of the rlfleet services and the agent loop that runs an episode.

    from rlfleet.envkit.sdk import AgentLoop, Clients, EpisodeSpec

    async with Clients.connect(session=..., sandbox=..., verifier=...) as clients:
        summary = await AgentLoop(clients).run(EpisodeSpec(task=task, session_id="my-task-s0"))
        print(summary.reward, summary.passed, summary.turns)

Your own environment: implement :class:`Environment` (`suite`, `tools`, `setup`, `run_tool`) and
`register_environment(suite, factory)`; see docs/custom-environment.md.
"""

from rlfleet.envkit.sdk.clients import Clients, RpcTimeouts, SandboxClient, SessionClient, VerifierClient
from rlfleet.envkit.sdk.environment import (
    CalcEnvironment,
    CodeEnvironment,
    Environment,
    InProcessCalcEnvironment,
    SandboxHandle,
    ToolResult,
    UnknownSuite,
    environment_for,
    environments,
    exec_observation,
    known_suites,
    register_environment,
)
from rlfleet.envkit.sdk.episode import AgentLoop, EpisodeHooks, EpisodeSpec, run_episode
from rlfleet.envkit.sdk.errors import (
    Backpressure,
    EpisodeError,
    PeerUnavailable,
    RequestRejected,
    RpcError,
    RpcNotFound,
    RpcUnimplemented,
    SandboxFailure,
    Superseded,
)
from rlfleet.envkit.sdk.framing import ChatMLFraming, TemplateFraming, TurnFraming, framing_for
from rlfleet.envkit.sdk.retry import Backoff
from rlfleet.envkit.sdk.summary import EpisodeSummary

__all__ = [
    "AgentLoop",
    "Backoff",
    "Backpressure",
    "CalcEnvironment",
    "ChatMLFraming",
    "Clients",
    "CodeEnvironment",
    "Environment",
    "EpisodeError",
    "EpisodeHooks",
    "EpisodeSpec",
    "EpisodeSummary",
    "InProcessCalcEnvironment",
    "PeerUnavailable",
    "RequestRejected",
    "RpcError",
    "RpcNotFound",
    "RpcTimeouts",
    "RpcUnimplemented",
    "SandboxClient",
    "SandboxFailure",
    "SandboxHandle",
    "SessionClient",
    "Superseded",
    "TemplateFraming",
    "ToolResult",
    "TurnFraming",
    "UnknownSuite",
    "VerifierClient",
    "environment_for",
    "environments",
    "exec_observation",
    "framing_for",
    "known_suites",
    "register_environment",
    "run_episode",
]
