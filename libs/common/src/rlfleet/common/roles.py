"""Who may call what: every RPC of rlfleet's API and the roles allowed to call it, deny by default.

A role is a principal kind (`environment`, `operator`, `service`) or one service by name
(`service:trainer`). A method that is not in `RULES` is refused to everyone (a new RPC needs a rule
here before anyone can call it; `tests/test_roles.py` fails until it has one). The standard health
service is open to any caller that completed the TLS handshake (probes); reflection needs an
authenticated caller.

What an environment client may do is further narrowed by ownership, in the services: it sees only
the sessions and sandboxes it created, in the run its token is for (`Principal.may_own`).
"""

from __future__ import annotations

from rlfleet.common.errors import PermissionDenied, Unauthenticated
from rlfleet.common.security import ENVIRONMENT, OPERATOR, SERVICE, Principal

ENV_CLIENT = frozenset({ENVIRONMENT, OPERATOR, SERVICE})  # an environment client's own work
ADMIN = frozenset({OPERATOR, SERVICE})  # the platform's machinery: operators and services
OPERATOR_ONLY = frozenset({OPERATOR})
# The run's control: the operator, and the controller service that drives runs for it (it audits the
# verifier, moves the gateway's admission with each version, hands out tasks and promotes).
CONTROL = frozenset({OPERATOR, "service:controller"})


def _service(name: str, **methods: frozenset[str]) -> dict[str, frozenset[str]]:
    return {f"/{name}/{method}": roles for method, roles in methods.items()}


RULES: dict[str, frozenset[str]] = {
    **_service("rlfleet.session.v1.SessionService",
               OpenSession=ENV_CLIENT, Generate=ENV_CLIENT, AppendObservation=ENV_CLIENT,
               GetSession=ENV_CLIENT, CloseSession=ENV_CLIENT, AbortSession=ENV_CLIENT,
               GetModelInfo=ENV_CLIENT),
    **_service("rlfleet.sandbox.v1.SandboxService",
               CreateSandbox=ENV_CLIENT, Exec=ENV_CLIENT, WriteFiles=ENV_CLIENT, ReadFiles=ENV_CLIENT,
               ListFiles=ENV_CLIENT, GetSandbox=ENV_CLIENT, DestroySandbox=ENV_CLIENT),
    **_service("rlfleet.verifier.v1.VerifierService",
               Verify=ENV_CLIENT, GetVerdict=ENV_CLIENT, Audit=CONTROL),
    # Engines draw the policy's tokens: registering, pausing or routing them is the platform's.
    **_service("rlfleet.gateway.v1.GatewayService",
               Generate=ADMIN, RegisterEngine=ADMIN, DeregisterEngine=ADMIN, ListEngines=ADMIN,
               PauseEngines=ADMIN, ResumeEngines=ADMIN, UpdateEngineState=ADMIN, Admit=ADMIN, Release=ADMIN,
               SetAdmissionPolicy=CONTROL, GetAdmissionStatus=ADMIN),
    # Only the trainer publishes policy versions; promotion and rollback are operator or service rights.
    **_service("rlfleet.broker.v1.BrokerService",
               PublishVersion=frozenset({OPERATOR, "service:trainer"}), GetStatus=ADMIN, ListVersions=ADMIN,
               Promote=ADMIN, PinCandidate=ADMIN, Rollback=ADMIN,
               StartDistributedSync=frozenset({OPERATOR, "service:trainer"}),
               # The trainer sending weights itself: the broker plans, the trainer sends and reports.
               StartTrainerSync=frozenset({OPERATOR, "service:trainer"}),
               FinishTrainerSync=frozenset({OPERATOR, "service:trainer"}),
               ConfirmTrainerSync=frozenset({OPERATOR, "service:trainer"})),
    **_service("rlfleet.trainer.v1.TrainerService",
               GetStatus=ADMIN, Checkpoint=ADMIN, Pause=ADMIN, Resume=ADMIN),
    # Starting and stopping a run is the operator's; services may look at it.
    **_service("rlfleet.controller.v1.RunControl",
               StartRun=OPERATOR_ONLY, StopRun=OPERATOR_ONLY, GetRun=ADMIN, WatchRun=ADMIN),
}
HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIX = "/grpc.reflection."


def is_public(method: str) -> bool:
    return method.startswith(HEALTH_PREFIX)


def open_to_environment(service_full_name: str) -> bool:
    """Whether any RPC of the service is an environment client's (its server then cannot demand a
    client certificate: those callers authenticate by token only)."""
    prefix = f"/{service_full_name}/"
    return any(m.startswith(prefix) and ENVIRONMENT in roles for m, roles in RULES.items())


def authorize(method: str, principal: Principal | None) -> None:
    """Raises Unauthenticated / PermissionDenied, naming the right that is missing."""
    if is_public(method):
        return
    if principal is None:
        raise Unauthenticated(f"{method} needs an authenticated caller: a client certificate of the run or "
                              "an `authorization: Bearer <token>` header (`rlfleet token issue`)",
                              right="authenticated", method=method)
    if method.startswith(REFLECTION_PREFIX):
        return
    allowed = RULES.get(method)
    if allowed is None:
        raise PermissionDenied(f"{method} has no access rule, so nobody may call it",
                               right=method, method=method)
    if not any(role in allowed for role in principal.roles()):
        needed = " or ".join(sorted(allowed))
        raise PermissionDenied(f"{method} needs the right of {needed}; the caller is {principal.owner}",
                               right=needed, method=method, caller=principal.owner)
