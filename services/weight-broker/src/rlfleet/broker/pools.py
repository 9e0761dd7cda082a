"""The engines the broker serves, in three pools (canary, candidate, fleet), and its links to them and
the gateway.

Engines come from the rollout gateway's `ListEngines` when a gateway is configured, else from the
static `engines` list of the config. `GatewayLink` wraps the gateway calls the broker makes (list,
pause/resume around a full reload, drain/un-drain) and degrades gracefully when the gateway lacks
an RPC (UNIMPLEMENTED: logged once, then the broker talks to the engine directly or skips it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import grpc

from rlfleet.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from rlfleet.broker.config import StaticEngine
from rlfleet.common import engine_requests as wire
from rlfleet.common.engine_client import EngineClient, EngineTimeouts
from rlfleet.common.errors import Unavailable
from rlfleet.common.grpc_server import channel

log = logging.getLogger(__name__)

POOL_NAMES = {gateway_pb2.ENGINE_POOL_CANARY: "canary", gateway_pb2.ENGINE_POOL_FLEET: "fleet",
              gateway_pb2.ENGINE_POOL_CANDIDATE: "candidate"}
# An engine registered without a kind is taken for a real SGLang server: SGLang's routes and load
# formats work on both kinds, the CPU engine's own store route on the CPU engine only.
KIND_NAMES = {gateway_pb2.ENGINE_KIND_CPU: "cpu", gateway_pb2.ENGINE_KIND_SGLANG: "sglang"}
PAUSE_MODES = {
    "abort": gateway_pb2.PAUSE_MODE_ABORT,
    "retract": gateway_pb2.PAUSE_MODE_RETRACT,
    "in_place": gateway_pb2.PAUSE_MODE_IN_PLACE,
}


@dataclass(frozen=True)
class EngineRef:
    engine_id: str
    url: str
    pool: str  # canary | candidate | fleet
    gateway_state: str = ""  # healthy | unhealthy | paused | draining (from the gateway); "" = no gateway
    kind: str = "sglang"  # cpu (rlfleet's CPU engine) | sglang: which weight transports it can take
    transport: str = ""  # its configured transport (static list); "" = the sync config's

    @property
    def draining(self) -> bool:
        return self.gateway_state == "draining"


class BrokerEngineClient(EngineClient):
    """The shared SGLang client plus the calls whose full reply the broker needs (pause time, bytes,
    changed share): the CPU engine's own weight-store loads (`/rlfleet/update_weights_from_store`,
    never sent to an SGLang engine), plain-directory loads and distributed updates."""

    async def load_from_store(self, model_path: str, kind: str, *, weight_version: str, pause_mode: str
                              ) -> dict[str, Any]:
        body = wire.update_weights_from_store(model_path, kind, weight_version=weight_version,
                                              pause_mode=pause_mode)
        return await self._weights("update_weights_from_store", body)

    async def load_directory(self, model_path: str, *, weight_version: str) -> dict[str, Any]:
        """SGLang's update_weights_from_disk of a plain HF directory, load format `auto`."""
        body = wire.update_weights_from_disk(model_path, weight_version=weight_version, flush_cache=True,
                                             abort_all_requests=False)
        return await self._weights("update_weights_from_disk", body)

    async def update_from_distributed(self, body: dict[str, Any], pause_mode: str | None = None,
                                      staged: bool = False) -> dict[str, Any]:
        """`pause_mode` and `staged` (CPU engine only): its rlfleet query parameters; SGLang's body has no
        such fields. Staged, the engine only receives and hashes; `update_from_staging(source=
        "distributed")` flips it in."""
        path = _with_pause("update_weights_from_distributed", pause_mode)
        if staged:
            path = ((path + "&" if path else wire.ROUTES["update_weights_from_distributed"][1] + "?")
                    + "staged=1")
        return await self._weights("update_weights_from_distributed", body, path=path)

    async def transfer_engine_info(self, rank: int = 0) -> dict[str, Any]:
        """SGLang's remote-instance endpoint description (where the P2P receive buffer lives)."""
        path = wire.ROUTES["remote_instance_transfer_engine_info"][1] + f"?rank={rank}"
        return await self._call("remote_instance_transfer_engine_info", None,
                                self.timeouts.control_s, path=path)

    async def update_from_staging(self, checksums: dict[str, str], algorithm: str, *, weight_version: str,
                                  pause_mode: str, source: str = "p2p",
                                  model_path: str = "") -> dict[str, Any]:
        body = wire.update_weights_from_staging(checksums, algorithm, weight_version=weight_version,
                                                pause_mode=pause_mode, source=source, model_path=model_path)
        return await self._weights("update_weights_from_staging", body)

    async def adopt_store_version(self, model_path: str, *, weight_version: str) -> dict[str, Any]:
        """CPU engine: it now holds the store's copy of the sent version it serves (checksums agreeing)."""
        return await self._weights("adopt_store_version",
                                   wire.adopt_store_version(model_path, weight_version=weight_version))

    async def discard_staged_broadcast(self) -> dict[str, Any]:
        return await self._weights("update_weights_from_staging", {"source": "distributed", "discard": True})

    async def update_from_tensor(self, serialized: list[str], *, weight_version: str, pause_mode: str | None,
                                 abort_all_requests: bool) -> dict[str, Any]:
        body = wire.update_weights_from_tensor(serialized, weight_version=weight_version, flush_cache=True,
                                               abort_all_requests=abort_all_requests)
        return await self._weights("update_weights_from_tensor", body,
                                   path=_with_pause("update_weights_from_tensor", pause_mode))


def _with_pause(route: str, pause_mode: str | None) -> str | None:
    return None if pause_mode is None else f"{wire.ROUTES[route][1]}?pause_mode={pause_mode}"


class GatewayLink:
    def __init__(self, address: str, timeout_s: float = 10.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._channel = channel(address)
        self.stub = gateway_pb2_grpc.GatewayServiceStub(self._channel)
        self.missing: set[str] = set()  # RPCs the gateway answered UNIMPLEMENTED

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, method: str, request: Any) -> Any | None:
        """The reply, or None when the gateway does not implement `method`; Unavailable otherwise."""
        if method in self.missing:
            return None
        try:
            return await getattr(self.stub, method)(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.warning("gateway %s does not implement %s: %s", self.address, method, exc.details())
                self.missing.add(method)
                return None
            raise Unavailable(f"gateway {self.address} {method}: {exc.code().name}: "
                              f"{exc.details()}") from None

    async def list_engines(self) -> list[EngineRef] | None:
        reply = await self._call("ListEngines", gateway_pb2.ListEnginesRequest())
        if reply is None:
            return None
        return [
            EngineRef(
                e.engine_id,
                e.url,
                POOL_NAMES.get(e.pool, "fleet"),
                gateway_pb2.EngineState.Name(e.state).removeprefix("ENGINE_STATE_").lower(),
                KIND_NAMES.get(e.kind, "sglang"),
            )
            for e in reply.engines
        ]

    async def pause(self, engine_id: str, mode: str) -> bool:
        """True when the gateway paused the engine (and knows it is paused)."""
        request = gateway_pb2.PauseEnginesRequest(engine_ids=[engine_id], mode=PAUSE_MODES[mode])
        reply = await self._call("PauseEngines", request)
        return reply is not None and all(r.ok for r in reply.results) and len(reply.results) == 1

    async def resume(self, engine_id: str) -> bool:
        reply = await self._call("ResumeEngines", gateway_pb2.ResumeEnginesRequest(engine_ids=[engine_id]))
        return reply is not None and all(r.ok for r in reply.results) and len(reply.results) == 1

    async def set_draining(self, engine_id: str, draining: bool, reason: str,
                           version: int | None = None) -> bool:
        """Marks the engine DRAINING or HEALTHY; False when the gateway cannot (UNIMPLEMENTED)."""
        state = gateway_pb2.ENGINE_STATE_DRAINING if draining else gateway_pb2.ENGINE_STATE_HEALTHY
        request = gateway_pb2.UpdateEngineStateRequest(engine_id=engine_id, state=state, reason=reason)
        if version is not None:
            request.policy_version = version
        return await self._call("UpdateEngineState", request) is not None


class Pools:
    """The current engines by id; refreshed from the gateway (or the static list) each reconcile."""

    def __init__(
        self, static: list[StaticEngine], gateway: GatewayLink | None, timeouts: EngineTimeouts, *,
        api_key: str = "", admin_api_key: str = "",
    ) -> None:
        self.static = [EngineRef(e.engine_id, e.url.rstrip("/"), e.pool, kind=e.kind,
                                 transport=e.transport or "")
                       for e in static]
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.gateway = gateway
        self.timeouts = timeouts
        self.engines: dict[str, EngineRef] = {e.engine_id: e for e in self.static}
        self._clients: dict[str, BrokerEngineClient] = {}
        self._closing: list[BrokerEngineClient] = []

    async def refresh(self) -> list[EngineRef]:
        if self.gateway is not None:
            try:
                listed = await self.gateway.list_engines()
            except Unavailable as exc:
                log.warning("keeping the last engine list: %s", exc)
                listed = None
            if listed is not None:
                self.engines = {e.engine_id: e for e in listed}
        while self._closing:
            await self._closing.pop().close()
        return list(self.engines.values())

    def members(self, pool: str) -> list[EngineRef]:
        return [e for e in self.engines.values() if e.pool == pool]

    def client(self, engine: EngineRef) -> BrokerEngineClient:
        current = self._clients.get(engine.engine_id)
        if current is None or current.base_url != engine.url.rstrip("/"):
            if current is not None:  # the engine moved: its old connections go
                self._closing.append(current)
            current = BrokerEngineClient(engine.url, timeouts=self.timeouts, api_key=self.api_key,
                                         admin_api_key=self.admin_api_key)
            self._clients[engine.engine_id] = current
        return current

    async def close(self) -> None:
        for client in [*self._clients.values(), *self._closing]:
            await client.close()
        self._clients.clear()
        self._closing.clear()
