"""Async client for rollout engines that speak SGLang's HTTP API: the built-in CPU engine or a real SGLang server.

Used by the rollout gateway (generation, health, pause/continue) and the weight broker (weight
updates, versions). Only SGLang field names go over the wire; rlfleet-only extras in replies
(e.g. `weight_version_spans`) are read when present and not required.

Errors: `EngineUnavailable` when the engine cannot be reached, times out or answers 5xx (worth a
retry elsewhere); `EngineRejected` when it answers 4xx or `success: false` (the request itself is
wrong; the engine's message is kept). Both are `EngineError`s carrying the url and status.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
from opentelemetry import trace

from rlfleet.common.telemetry import current_trace_context

PauseMode = Literal["abort", "retract", "in_place"]


_tracer = trace.get_tracer("rlfleet.engine_client")


class EngineError(Exception):
    def __init__(self, message: str, *, url: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.url = url
        self.status = status


class EngineUnavailable(EngineError):
    """Connection refused/reset, timeout, or a 5xx answer."""


class EngineRejected(EngineError):
    """A 4xx answer or `success: false`: the engine refused this request and said why."""


@dataclass(frozen=True)
class EngineTimeouts:
    connect_s: float = 5.0
    generate_s: float = 600.0
    control_s: float = 60.0
    # Weight updates include reading a checkpoint or receiving a broadcast, and a group init waits
    # for every rank to join.
    weights_s: float = 600.0


@dataclass(frozen=True)
class GenerateResult:
    rid: str
    output_ids: list[int]
    output_logprobs: list[float] | None
    finish_reason: str  # "stop" | "length" | "abort"
    matched: int | str | None  # the stop token id or stop string, when finish_reason == "stop"
    finish_message: str | None  # why, when finish_reason == "abort"
    weight_version: str
    weight_version_spans: list[tuple[str, int, int]] | None  # rlfleet CPU engine only
    prompt_tokens: int
    cached_tokens: int
    latency: float  # seconds, the engine's e2e_latency (client-measured if it sent none)
    text: str


class EngineClient:
    def __init__(
        self,
        base_url: str,
        *,
        timeouts: EngineTimeouts | None = None,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeouts = timeouts or EngineTimeouts()
        self._session = session
        self._owns_session = session is None

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    # --- generation -----------------------------------------------------------------------------
    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any] | None = None,
        *,
        return_logprob: bool = True,
        rid: str | None = None,
    ) -> GenerateResult:
        body: dict[str, Any] = {
            # A list is sent as is (it is serialized right here); any other sequence is copied into one.
            "input_ids": input_ids if type(input_ids) is list else list(input_ids),
            "sampling_params": dict(sampling_params or {}),
            "return_logprob": return_logprob,
        }
        if rid is not None:
            body["rid"] = rid
        started = time.monotonic()
        # A client span per engine call: the engine's own spans (SGLang's tracing) join the episode's
        # trace through the traceparent header `_request` sends.
        with _tracer.start_as_current_span("engine POST /generate", kind=trace.SpanKind.CLIENT,
                                           attributes={"server.address": self.base_url,
                                                       "rlfleet.input_tokens": len(body["input_ids"])}) as span:
            reply = await self._request("POST", "/generate", body, self.timeouts.generate_s)
            result = _generate_result(reply, time.monotonic() - started)
            span.set_attributes({"rlfleet.output_tokens": len(result.output_ids),
                                 "rlfleet.weight_version": result.weight_version})
        return result

    async def generate_batch(
        self,
        batch: list[list[int]],
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        *,
        return_logprob: bool = True,
    ) -> list[GenerateResult]:
        body = {
            "input_ids": [list(ids) for ids in batch],
            "sampling_params": sampling_params or {},
            "return_logprob": return_logprob,
        }
        started = time.monotonic()
        replies = await self._request("POST", "/generate", body, self.timeouts.generate_s)
        return [_generate_result(reply, time.monotonic() - started) for reply in replies]

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        await self._request(
            "POST", "/abort_request", {"rid": rid or "", "abort_all": abort_all}, self.timeouts.control_s
        )

    # --- health and info ------------------------------------------------------------------------
    async def health(self, *, generate: bool = False) -> bool:
        """True when the engine answers `/health` (or `/health_generate`, which runs the model)."""
        try:
            await self._request(
                "GET", "/health_generate" if generate else "/health", None, self.timeouts.control_s
            )
        except EngineError:
            return False
        return True

    async def model_info(self) -> dict[str, Any]:
        return await self._request("GET", "/get_model_info", None, self.timeouts.control_s)

    async def load(self) -> dict[str, Any]:
        """SGLang's `/get_load` for the first DP rank: num_reqs, num_waiting_reqs, num_tokens, ..."""
        reply = await self._request("GET", "/get_load", None, self.timeouts.control_s)
        return reply[0] if isinstance(reply, list) else reply

    async def weight_version(self) -> str:
        return (await self._request("GET", "/get_weight_version", None, self.timeouts.control_s))[
            "weight_version"
        ]

    async def update_weight_version(self, new_version: str, *, abort_all_requests: bool = False) -> None:
        body = {"new_version": new_version, "abort_all_requests": abort_all_requests}
        await self._request("POST", "/update_weight_version", body, self.timeouts.control_s)

    # --- pause and cache ------------------------------------------------------------------------
    async def pause(self, mode: PauseMode = "abort") -> None:
        await self._request("POST", "/pause_generation", {"mode": mode}, self.timeouts.control_s)

    async def resume(self) -> None:
        await self._request("POST", "/continue_generation", {}, self.timeouts.control_s)

    async def flush_cache(self) -> None:
        """Raises EngineRejected (with the engine's reason) when the engine refuses to flush."""
        await self._request("POST", "/flush_cache", None, self.timeouts.control_s)

    # --- weight updates (each returns the engine's message; failures raise EngineRejected) -----
    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> str:
        body = {
            "model_path": str(model_path),
            "weight_version": weight_version,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        return await self._weights("/update_weights_from_disk", body)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
    ) -> str:
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return await self._weights("/init_weights_update_group", body)

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        *,
        group_name: str = "weight_update_group",
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> str:
        body = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "weight_version": weight_version,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        return await self._weights("/update_weights_from_distributed", body)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> str:
        return await self._weights("/destroy_weights_update_group", {"group_name": group_name})

    # --- transport ------------------------------------------------------------------------------
    async def _weights(self, path: str, body: dict[str, Any]) -> str:
        reply = await self._request("POST", path, body, self.timeouts.weights_s)
        if isinstance(reply, dict) and reply.get("success") is False:
            raise EngineRejected(
                str(reply.get("message", "weight update failed")), url=self.base_url + path, status=200
            )
        return str(reply.get("message", "")) if isinstance(reply, dict) else ""

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def _request(self, method: str, path: str, body: Any, timeout_s: float) -> Any:
        url = self.base_url + path
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.timeouts.connect_s)
        try:
            async with self._client().request(method, url, json=body, timeout=timeout,
                                              headers=current_trace_context()) as response:
                text = await response.text()
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineUnavailable(f"{method} {url} failed: {exc!r}", url=url) from exc
        if status >= 500:
            raise EngineUnavailable(
                f"{method} {url}: HTTP {status}: {_message(text)}", url=url, status=status
            )
        if status >= 400:
            raise EngineRejected(_message(text), url=url, status=status)
        try:
            return json.loads(text) if text.strip() else {}
        except ValueError:
            return {"message": text.strip()}


def _message(text: str) -> str:
    """The error message in SGLang's shapes: {"error": {"message"}}, {"message"}, {"detail"} or plain text."""
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip()
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if key in body:
                return str(body[key])
    return text.strip()


def _generate_result(reply: dict[str, Any], measured: float) -> GenerateResult:
    meta = reply.get("meta_info", {})
    finish = meta.get("finish_reason") or {}
    logprobs = meta.get("output_token_logprobs")
    spans = meta.get("weight_version_spans")
    return GenerateResult(
        rid=str(meta.get("id", "")),
        output_ids=list(reply.get("output_ids", [])),
        output_logprobs=None if logprobs is None else [float(entry[0]) for entry in logprobs],
        finish_reason=str(finish.get("type", "abort")),
        matched=finish.get("matched"),
        finish_message=finish.get("message"),
        weight_version=str(meta.get("weight_version", "")),
        weight_version_spans=None if spans is None else [(str(v), int(s), int(e)) for v, s, e in spans],
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        cached_tokens=int(meta.get("cached_tokens", 0)),
        latency=float(meta.get("e2e_latency", measured)),
        text=str(reply.get("text", "")),
    )
