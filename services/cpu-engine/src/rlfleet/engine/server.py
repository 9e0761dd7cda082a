"""The HTTP layer: SGLang 0.5.23's routes over the scheduler, on aiohttp.

Route names, request fields, reply keys and error behaviour are SGLang's for everything rlfleet uses
(tests/contract checks them against the snapshot taken from SGLang's package): `/model_info`,
`/server_info`, `/v1/loads`, `/v1/models` (loaded adapters as model cards), per-token
`meta_info.weight_versions`, LoRA adapters (`/load_lora_adapter`, `/unload_lora_adapter`,
`lora_path` per request: `lora.py`), `update_weights_from_disk` with
SGLang's load formats only (an unknown one is an error, never a silent success), `--api-key` /
`--admin-api-key` as `Authorization: Bearer`. What SGLang has no route for lives under `/rlfleet/`
(`/rlfleet/update_weights_from_store`: weight-store deltas and exact full loads).

Handlers never touch the model: generation goes through `Scheduler.submit`, control through
`Scheduler.call` (run between two steps). Slow blocking work that does not touch the model --
reading a checkpoint, joining a process group, receiving broadcast tensors -- runs in worker
threads, so it neither stalls the event loop nor the decode loop; only the final swap is a
scheduler command. Bad input answers 400 with `{"error": {"message": ...}}` as SGLang does.

Tracing (when on: an exporter configured): `/generate` and the control and weight-update routes
are SERVER spans, children of the caller's W3C `traceparent` (the gateway's `engine POST /generate`
client span), so an episode's trace reaches into the engine. A generate span lives as long as its handler
awaits the scheduler's reply -- queued, prefilled, decoded, finished -- and is described once, from the reply
(tokens in and out, finish reason, queue wait, weight version): the scheduler thread never touches it, and
nothing is recorded per token. Health and load polls are not traced.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from rlfleet.common.engine_requests import RLFLEET_ROUTES, SGLANG_VERSION, STORE_KINDS
from rlfleet.common.errors import OncePerPeer, StartupError, clip
from rlfleet.common.security import engine_keys
from rlfleet.common.service import stop_on_signals, write_ready_file
from rlfleet.common.telemetry import setup_telemetry, tracing_enabled
from rlfleet.engine.config import EngineConfig
from rlfleet.engine.lora import Adapter, LoRALoadError, read_adapter
from rlfleet.engine.model_runner import LOAD_FORMATS, ModelRunner, WeightLoadError, read_checkpoint
from rlfleet.engine.peer_staging import PeerStaging
from rlfleet.engine.protocol import (
    BadRequest,
    GenerateItem,
    Limits,
    SamplingSpec,
    check_input_size,
    parse_generate,
)
from rlfleet.engine.scheduler import PAUSE_MODES, PauseMode, Request, RequestOutput, Scheduler, is_pause_mode
from rlfleet.engine.store_weights import StoreLoadError, StoreWeights
from rlfleet.weights import broadcast as distributed
from rlfleet.weights.errors import PathOutsideStore
from rlfleet.weights.fsutil import confine
from rlfleet.weights.p2p import P2PError
from rlfleet.weights.sent import DEFAULT_ALGORITHM, tensor_checksums
from rlfleet.weights.sent_checks import mismatched
from rlfleet.weights.tensor_ipc import TensorPayloadError
from rlfleet.weights.tensor_ipc import deserialize as deserialize_tensors

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 20.0
ENGINE_VERSION = f"rlfleet-cpu-engine (SGLang {SGLANG_VERSION} API)"
STORE_ROUTE = RLFLEET_ROUTES["update_weights_from_store"][1]  # rlfleet-only: SGLang has no such route
STAGING_ROUTE = RLFLEET_ROUTES["update_weights_from_staging"][1]  # rlfleet-only: P2P staging -> model
ADOPT_ROUTE = RLFLEET_ROUTES["adopt_store_version"][1]  # rlfleet-only: the store's copy of a sent version
STAGING_SOURCES = ("p2p", "distributed")  # what update_weights_from_staging flips in
SERVICE_NAME = "rlfleet-cpu-engine"


@dataclass
class StagedBroadcast:
    """A broadcast received with `staged=1`: cast to fp32, hashed, not yet served."""

    prepared: list[Any]
    checksums: dict[str, str]
    algorithm: str
    nbytes: int
    version: str | None
# Routes that do work worth a span; the polled ones (health, load, info, version) are left out.
TRACED_ROUTES = frozenset(
    {
        "/generate",
        "/abort_request",
        "/flush_cache",
        "/pause_generation",
        "/continue_generation",
        "/update_weights_from_disk",
        "/update_weight_version",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/destroy_weights_update_group",
        "/load_lora_adapter",
        "/unload_lora_adapter",
        "/update_weights_from_tensor",
        STORE_ROUTE,
        STAGING_ROUTE,
        ADOPT_ROUTE,
    }
)
# SGLang's auth levels (sglang.srt.utils.auth) of the routes served here that are not NORMAL: with
# an admin key set they take only it; with only an API key, that one. Health routes are always open.
ADMIN_ROUTES = frozenset(
    {
        "/abort_request",
        "/flush_cache",
        "/pause_generation",
        "/continue_generation",
        "/update_weights_from_disk",
        "/update_weight_version",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/destroy_weights_update_group",
        "/get_weights_by_name",
        "/load_lora_adapter",
        "/unload_lora_adapter",
        "/update_weights_from_tensor",
        "/remote_instance_transfer_engine_info",
        STORE_ROUTE,
        STAGING_ROUTE,
        ADOPT_ROUTE,
    }
)


class EngineServer:
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        scheduler: Scheduler,
        tracer: trace.Tracer | None = None,
    ) -> None:

        self.config = config
        # Without a tracer given or spans to export, requests are not wrapped in spans at all.
        self.traced = tracer is not None or tracing_enabled()
        self.tracer = tracer or trace.get_tracer("rlfleet.engine")
        self.runner = runner
        self.scheduler = scheduler
        self.engine_id = config.engine_id or f"cpu-engine-{os.getpid()}"
        context = config.context_length or runner.max_position_embeddings
        self.limits = Limits(runner.vocab_size, context, config.max_total_tokens, config.max_text_chars)
        self._groups: dict[str, Any] = {}
        self._groups_lock = threading.Lock()
        self.store = StoreWeights(runner, config.weight_store_root, config.weight_store_workers)
        self.staging = PeerStaging(getattr(runner, "_params", {}), config.p2p_hostname, config.p2p_protocol,
                                   config.p2p_device)
        # One weight update at a time: a store load prepares against the version held at its start.
        self._weights_lock = asyncio.Lock()
        self._staged_broadcast: StagedBroadcast | None = None
        # One adapter load or unload at a time. Every name ever loaded, with its path and pinning:
        # SGLang's tokenizer manager keeps the same (`lora_ref_cache`) and reloads an unloaded
        # adapter when a request names it again.
        self._lora_lock = asyncio.Lock()
        self._lora_refs: dict[str, tuple[str, bool]] = {}

    def app(self) -> web.Application:
        middlewares = [self._authorized, *([self._traced] if self.traced else [])]
        app = web.Application(client_max_size=self.config.max_request_bytes, middlewares=middlewares)
        app[MAX_REQUEST_BYTES] = self.config.max_request_bytes
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/abort_request", self.abort_request)
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health_generate)
        app.router.add_get("/model_info", self.model_info)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/v1/loads", self.loads)
        app.router.add_get("/v1/models", self.models)
        app.router.add_route("GET", "/flush_cache", self.flush_cache)
        app.router.add_route("POST", "/flush_cache", self.flush_cache)
        app.router.add_post("/pause_generation", self.pause_generation)
        app.router.add_post("/continue_generation", self.continue_generation)
        app.router.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        app.router.add_post(STORE_ROUTE, self.update_weights_from_store)
        app.router.add_post("/update_weight_version", self.update_weight_version)
        app.router.add_post("/init_weights_update_group", self.init_weights_update_group)
        app.router.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        app.router.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        app.router.add_post("/update_weights_from_tensor", self.update_weights_from_tensor)
        app.router.add_get("/remote_instance_transfer_engine_info", self.remote_instance_transfer_engine_info)
        app.router.add_post(STAGING_ROUTE, self.update_weights_from_staging)
        app.router.add_post(ADOPT_ROUTE, self.adopt_store_version)
        app.router.add_route("GET", "/get_weights_by_name", self.get_weights_by_name)
        app.router.add_route("POST", "/get_weights_by_name", self.get_weights_by_name)
        app.router.add_post("/load_lora_adapter", self.load_lora_adapter)
        app.router.add_post("/unload_lora_adapter", self.unload_lora_adapter)
        return app

    # --- auth ------------------------------------------------------------------------------------
    @web.middleware
    async def _authorized(self, request: web.Request, handler) -> web.StreamResponse:
        """SGLang's decide_request_auth for NORMAL and ADMIN_OPTIONAL routes: 401 without the right key."""
        api_key, admin_key = self.config.api_key, self.config.admin_api_key
        if not (api_key or admin_key) or request.path.startswith(("/health", "/ready", "/metrics")):
            return await handler(request)
        wanted = (admin_key or api_key) if request.path in ADMIN_ROUTES else api_key
        if wanted is None:
            return await handler(request)
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token, wanted):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    # --- tracing --------------------------------------------------------------------------------
    @web.middleware
    async def _traced(self, request: web.Request, handler) -> web.StreamResponse:
        """A SERVER span around a traced route, continuing the caller's trace when it sent one.

        Handlers describe their work on `trace.get_current_span()`; this records the outcome."""
        if request.path not in TRACED_ROUTES:
            return await handler(request)
        parent = propagate.extract(request.headers)
        attributes = {
            "http.request.method": request.method,
            "url.path": request.path,
            "rlfleet.engine_id": self.engine_id,
        }
        with self.tracer.start_as_current_span(
            f"{request.method} {request.path}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                response = await handler(request)
            except web.HTTPException as exc:
                _record_status(span, exc.status)
                raise
            except asyncio.CancelledError:
                span.set_status(Status(StatusCode.ERROR, "client disconnected"))
                raise
            except Exception as exc:
                span.record_exception(exc)
                _record_status(span, 500, f"{type(exc).__name__}: {exc}")
                raise
            _record_status(span, response.status)
            return response

    # --- generation -----------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.Response:
        try:
            body = await _body(request)
            check_input_size(body, self.limits)  # on the loop: refused before any tokenizing
            # Tokenizing (and checking every id) happens in a worker thread, so a long prompt never
            # holds up /health or other requests (the tokenizer releases the GIL: ModelRunner.encode).
            items, is_batch = await asyncio.to_thread(parse_generate, body, self.limits, self.runner.encode)
            adapters = await self._adapters_for(items)
        except BadRequest as exc:
            return _error(str(exc), status=exc.status, **exc.details)
        outputs = await self._run(items, adapters)
        _describe_generation(trace.get_current_span(), items, outputs)
        if any(out.finish_reason.get("status_code") == 500 for out in outputs):
            return _error(outputs[0].finish_reason.get("message", "engine error"), status=500)
        results = [_result(item, out) for item, out in zip(items, outputs, strict=True)]
        return web.json_response(results if is_batch else results[0])

    async def _run(self, items: list[GenerateItem],
                   adapters: list[Adapter | None] | None = None) -> list[RequestOutput]:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in items]
        adapters = adapters or [None] * len(items)

        def deliver(future: asyncio.Future, output: RequestOutput) -> None:
            if not future.done():
                future.set_result(output)

        for item, future, adapter in zip(items, futures, adapters, strict=True):
            callback = lambda out, f=future: loop.call_soon_threadsafe(deliver, f, out)  # noqa: E731
            self.scheduler.submit(Request(item, self.runner.eos_token_ids, callback, adapter))
        try:
            return list(await asyncio.gather(*futures))
        except asyncio.CancelledError:
            # The client went away (handler cancellation is on): free its batch slots.
            for item in items:
                self.scheduler.call(
                    functools.partial(self.scheduler.abort, rid=item.rid, message="client disconnected")
                )
            raise

    async def _adapters_for(self, items: list[GenerateItem]) -> list[Adapter | None]:
        """Each item's adapter, as SGLang's tokenizer manager resolves `lora_path`: a loaded name, or
        one loaded before and unloaded since (loaded again from its path); any other name is refused."""
        resolved: dict[str, Adapter] = {}
        for name in {item.lora_path for item in items if item.lora_path is not None}:
            adapter = self.runner.lora.adapters.get(name)
            if adapter is None and name not in self._lora_refs:
                raise BadRequest(f"Got LoRA adapter that has never been loaded: {name}\n"
                                 f"All loaded adapters: {sorted(self.runner.lora.adapters)}.",
                                 field="lora_path")
            resolved[name] = adapter or await self._reload(name)
        return [None if item.lora_path is None else resolved[item.lora_path] for item in items]

    async def _reload(self, name: str) -> Adapter:
        """An adapter unloaded since, loaded again from its path (unless a concurrent request did)."""
        path, pinned = self._lora_refs[name]
        async with self._lora_lock:
            adapter = self.runner.lora.adapters.get(name)
            if adapter is not None:
                return adapter
            try:
                return (await self._load_adapter(name, path, pinned))[0]
            except LoRALoadError as exc:
                raise BadRequest(f"Failed to implicitly load LoRA adapter {name}: {exc}",
                                 field="lora_path") from None

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _body(request)
        rid, abort_all = body.get("rid"), bool(body.get("abort_all", False))
        if not abort_all and not isinstance(rid, str):
            return _error("abort_request needs 'rid' (a string) or 'abort_all': true")
        await self._call(
            lambda: self.scheduler.abort(rid=rid, abort_all=abort_all, message="aborted by abort_request")
        )
        return web.Response(status=200)

    # --- health and info ------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        if self.scheduler.paused is not None:
            # Paused on purpose (a weight swap): healthy, and a probe must not queue behind the pause.
            return web.json_response({"status": "ok", "paused": self.scheduler.paused})
        probe = GenerateItem(
            f"health-{os.urandom(6).hex()}",
            [self._probe_token()],
            SamplingSpec(max_new_tokens=1, temperature=0.0),
        )
        try:
            await asyncio.wait_for(self._run([probe]), HEALTH_TIMEOUT_S)
        except TimeoutError:
            return _error("health probe did not finish in time", status=503)
        return web.json_response({"status": "ok"})

    def _probe_token(self) -> int:
        return next(i for i in range(self.runner.vocab_size) if i not in self.runner.eos_token_ids)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": str(self.runner.model_path),
                "tokenizer_path": str(self.runner.model_path),
                "is_generation": True,
                "weight_version": self.scheduler.weight_version,
                "load_format": "auto",
                # rlfleet extension: the weight-store version whose exact bytes are served, if any.
                "weight_store_version": self.store.held_version,
                "weight_store_path": self.store.held_path,
                "engine_id": self.engine_id,
                "engine_kind": "rlfleet-cpu",
                "vocab_size": self.runner.vocab_size,
                "context_length": self.limits.context_length,
                "eos_token_ids": sorted(self.runner.eos_token_ids),
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        load = await self._call(self.scheduler.load)
        config = self.config.model_dump(mode="json", exclude={"api_key", "admin_api_key"})
        # tp_size / dp_size as SGLang's server_info names them: one rank, no data parallelism.
        return web.json_response({**config, **load, "engine_id": self.engine_id, "tp_size": 1, "dp_size": 1})

    async def models(self, request: web.Request) -> web.Response:
        """SGLang's `/v1/models` (OpenAI's model list): the base model's card, then one card per loaded
        adapter with `parent` = the base and `root` = the directory it was loaded from. The broker
        compares this with what it loaded here, so a restarted engine (holding none) is reloaded."""
        base = str(self.runner.model_path)
        created = int(time.time())
        loaded = await self._call(self.runner.lora.loaded)  # between two steps: the set is not changing
        cards = [{"id": base, "object": "model", "created": created, "owned_by": "sglang", "root": base,
                  "parent": None, "max_model_len": self.limits.context_length}]
        cards += [{"id": name, "object": "model", "created": created, "owned_by": "sglang", "root": path,
                   "parent": base, "max_model_len": None} for name, path in sorted(loaded.items())]
        return web.json_response({"object": "list", "data": cards})

    async def loads(self, request: web.Request) -> web.Response:
        """SGLang's `/v1/loads`: one LoadSnapshot per DP rank (here one) under `loads`."""
        load = await self._call(self.scheduler.load)
        snapshot = {
            "timestamp": time.time(),
            "dp_rank": 0,
            "num_running_reqs": load["num_running_reqs"],
            "num_waiting_reqs": load["num_waiting_reqs"],
            "num_used_tokens": load["num_tokens"],
            "max_total_num_tokens": self.config.max_total_tokens,
            "max_running_requests": self.config.max_running_requests,
            "token_usage": load["num_tokens"] / max(self.config.max_total_tokens, 1),
            "cache_hit_rate": load["prefix_cache_hits"] / load["prefix_cache_lookups"]
            if load["prefix_cache_lookups"] else 0.0,
        }
        return web.json_response({"timestamp": snapshot["timestamp"], "version": ENGINE_VERSION,
                                  "accelerator": "cpu", "num_accelerators": 0, "loads": [snapshot]})

    # --- pause, cache, versions -----------------------------------------------------------------
    async def flush_cache(self, request: web.Request) -> web.Response:
        success, message = await self._call(self.scheduler.flush_cache)
        return web.Response(text=message + "\n", status=200 if success else 400)

    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = (await _body(request)).get("mode", "abort")
        if not is_pause_mode(mode):
            return _error(f"unknown pause mode {mode!r}; expected one of {', '.join(PAUSE_MODES)}")
        await self._call(lambda: self.scheduler.pause(mode))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self._call(self.scheduler.resume)
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await _body(request)
        version = body.get("new_version")
        if not isinstance(version, str) or not version:
            return _error("update_weight_version needs 'new_version' (a non-empty string)")
        abort_all = bool(body.get("abort_all_requests", False))
        await self._call(lambda: self.scheduler.set_weight_version(version, abort_all))
        trace.get_current_span().set_attribute("rlfleet.weight_version", version)
        return web.json_response(
            {"success": True, "message": f"Weight version updated to {version}", "new_version": version}
        )

    # --- weight updates -------------------------------------------------------------------------
    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await _body(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            return _error("update_weights_from_disk needs 'model_path'")
        load_format = body.get("load_format")
        if load_format is not None and load_format not in LOAD_FORMATS:
            # SGLang raises on a load format outside its LoadFormat enum (and its scheduler then takes
            # the server down); a stand-in that accepted one would hide that. Refused, nothing changes.
            return _weight_reply(False, f"load_format {load_format!r} is not supported by this engine; "
                                        f"use one of {', '.join(LOAD_FORMATS)}")
        version = _optional_str(body, "weight_version")
        refused = self._outside_store(path)
        if refused:
            return _weight_reply(False, refused, 403)
        async with self._weights_lock:
            try:
                named = await asyncio.to_thread(read_checkpoint, Path(path))
            except (WeightLoadError, OSError, ValueError) as exc:
                return _weight_reply(False, f"Failed to read {path}: {exc}")
            return await self._swap(named, version, _pause_mode(request, body))

    def _outside_store(self, path: str) -> str:
        """Why `path` may not be loaded ("" when it may): weights come only from under the weight
        store root, never from any path on the host."""
        root = self.store.root
        if root is None:
            return "this engine has no weight_store_root: it loads weights from nowhere on disk"
        try:
            confine(Path(path), root)
        except PathOutsideStore:
            return f"model_path {path[:300]!r} is outside the weight store root {str(root)!r}"
        return ""

    async def update_weights_from_store(self, request: web.Request) -> web.Response:
        """rlfleet-only: a weight-store version, `kind` delta or full; prepared while serving, then a
        pause for the swap only.

        The pause mode is the request's `pause_mode` (abort | retract | in_place; default retract,
        abort when `abort_all_requests`). An engine that is already paused (by the gateway, around a
        full reload) stays paused: the caller resumes it.
        """
        body = await _body(request)
        path, kind = body.get("model_path"), body.get("kind")
        if not isinstance(path, str) or not path:
            return _error("update_weights_from_store needs 'model_path'")
        if kind not in STORE_KINDS:
            return _error(f"update_weights_from_store needs 'kind', one of {', '.join(STORE_KINDS)}")
        mode = "abort" if body.get("abort_all_requests") else body.get("pause_mode", "retract")
        if not is_pause_mode(mode):
            return _error(f"unknown pause_mode {mode!r}; expected one of {', '.join(PAUSE_MODES)}")
        async with self._weights_lock:
            try:
                ref = self.store.locate(path)
                install: Callable[[], None]
                finish: Callable[[], object] | None
                if kind == "delta":
                    delta = await asyncio.to_thread(self.store.prepare_delta, ref)
                    install = functools.partial(self.store.swap_delta, delta)
                    finish = functools.partial(self.store.finish_delta, delta)
                    stats = {
                        "base_version": delta.decoded.base_version,
                        "fetch_s": delta.fetch_s,
                        "preverify_s": delta.preverify_s,
                        "stage_s": delta.stage_s,
                        "bytes": delta.payload_bytes,
                        "changed_fraction": delta.changed_fraction,
                    }
                else:
                    full = await asyncio.to_thread(self.store.prepare_full, ref)
                    install, finish = functools.partial(self.store.install_full, full), None
                    stats = {"load_s": full.load_s, "bytes": full.bytes_read}
            except StoreLoadError as exc:
                return _weight_reply(False, f"Failed to load {path} ({kind}): {exc}")
            version = _optional_str(body, "weight_version") or str(ref.version)

            def swap() -> tuple[int, float]:
                own_pause = self.scheduler.paused is None
                started = time.perf_counter()
                queued = len(self.scheduler.running) + len(self.scheduler.waiting)
                if own_pause:
                    self.scheduler.pause(mode)
                try:
                    install()
                    self.scheduler.weight_version = version
                finally:
                    if own_pause:
                        self.scheduler.resume()
                return queued, time.perf_counter() - started

            paused_requests, pause_s = await self._call(swap)
            if finish is not None:
                await asyncio.to_thread(finish)
        return _weight_reply(
            True,
            f"Succeeded to update model weights to store version {ref.version} ({kind}).",
            weight_version=version,
            store_version=ref.version,
            kind=kind,
            pause_mode=mode,
            pause_s=pause_s,
            num_paused_requests=paused_requests,
            **stats,
        )

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await _body(request)
        try:
            address, port = str(body["master_address"]), int(body["master_port"])
            rank_offset, world_size = int(body["rank_offset"]), int(body["world_size"])
        except (KeyError, TypeError, ValueError) as exc:
            return _error(
                "init_weights_update_group needs master_address, master_port, "
                f"rank_offset, world_size ({exc})"
            )
        name = str(body.get("group_name", "weight_update_group"))
        backend = str(body.get("backend", "gloo"))
        if backend != "gloo":
            return _weight_reply(False, f"backend {backend!r} is not available on the CPU engine; use gloo")
        with self._groups_lock:
            if name in self._groups:
                return _weight_reply(False, f"a weight update group named {name!r} already exists")
        try:
            group = await asyncio.to_thread(
                distributed.join_group,
                address,
                port,
                rank_offset,
                world_size,
                name,
                backend,
                self.config.dist_timeout_s,
            )
        except Exception as exc:  # rendezvous failures come in many types; report them all
            return _weight_reply(False, f"Failed to init group {name!r}: {exc}")
        with self._groups_lock:
            self._groups[name] = group
        return _weight_reply(True, f"Succeeded to initialize custom process group {name!r}.")

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await _body(request)
        name = str(body.get("group_name", "weight_update_group"))
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            return _error("update_weights_from_distributed needs lists 'names', 'dtypes' and 'shapes'")
        if not len(names) == len(dtypes) == len(shapes):
            return _error("'names', 'dtypes' and 'shapes' must have the same length")
        with self._groups_lock:
            group = self._groups.get(name)
        if group is None:
            return _weight_reply(
                False, f"no weight update group named {name!r}; call init_weights_update_group"
            )
        staged = request.query.get("staged") in ("1", "true")
        async with self._weights_lock:
            try:
                # The sender is already broadcasting: receive everything even if a name turns out to be
                # wrong, so the two sides stay in step; the load below then refuses the whole update.
                named = await asyncio.to_thread(distributed.receive, group, names, dtypes, shapes)
            except Exception as exc:
                return _weight_reply(False, f"Failed to receive weights over {name!r}: {exc}")
            version = _optional_str(body, "weight_version")
            sums = await asyncio.to_thread(tensor_checksums, named)
            if staged:
                return await self._stage_broadcast(named, sums, version)
            return await self._swap(named, version, _pause_mode(request, body), checksums=sums,
                                    checksum_algorithm=DEFAULT_ALGORITHM)

    async def _stage_broadcast(self, named, sums: dict[str, str], version: str | None) -> web.Response:
        """rlfleet's staged broadcast (query `staged=1`): what arrived is checked against the model and
        cast to fp32 while the engine keeps serving, then held until `/rlfleet/update_weights_from_staging`
        (`source` distributed) verifies it against the trainer's checksums and flips it in, or drops it."""
        try:
            prepared = await asyncio.to_thread(self.runner.prepare_weights, named)
        except WeightLoadError as exc:
            return _weight_reply(False, f"Failed to stage weights: {exc}")
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        self._staged_broadcast = StagedBroadcast(prepared, sums, DEFAULT_ALGORITHM, nbytes, version)
        return _weight_reply(True, f"Staged {len(prepared)} tensors (version {version}); not served until "
                                   "update_weights_from_staging", staged=True, checksums=sums,
                             checksum_algorithm=DEFAULT_ALGORITHM, bytes=nbytes)

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        name = str((await _body(request)).get("group_name", "weight_update_group"))
        with self._groups_lock:
            group = self._groups.pop(name, None)
        if group is None:
            return _weight_reply(False, f"no weight update group named {name!r}")
        await asyncio.to_thread(distributed.leave_group, group)
        return _weight_reply(True, f"Succeeded to destroy custom process group {name!r}.")

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        """SGLang's debugging read-back: the first `truncate_size` rows of a parameter, as fp32 values."""
        body = await _body(request)
        name, size = body.get("name"), body.get("truncate_size", 100)
        if not isinstance(name, str) or not isinstance(size, int) or size < 1:
            return _error("get_weights_by_name needs 'name' and a positive integer 'truncate_size'")

        def read():
            param = self.runner.parameter(name)
            return param.narrow(0, 0, min(size, param.shape[0])).tolist() if param.dim() else param.item()

        try:
            return web.json_response(await self._call(read))
        except KeyError:
            return _error(f"unknown parameter {name!r}")

    # --- LoRA adapters --------------------------------------------------------------------------
    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """SGLang's LoadLoRAAdapterReqInput: the file reading and checks run in a worker thread; the
        scheduler pauses only for the install (a dict update: `pause_s` in the reply)."""
        body = await _body(request)
        name, path, pinned = body.get("lora_name"), body.get("lora_path"), body.get("pinned", False)
        if not (isinstance(name, str) and name and isinstance(path, str) and path
                and isinstance(pinned, bool)):
            return _lora_reply(False, "load_lora_adapter needs 'lora_name' and 'lora_path' (non-empty "
                                      "strings) and optionally 'pinned' (true or false)")
        async with self._lora_lock:
            try:
                adapter, pause_s = await self._load_adapter(name, path, pinned)
            except LoRALoadError as exc:
                return _lora_reply(False, str(exc))
        trace.get_current_span().set_attributes({"rlfleet.lora_name": name,
                                                 "rlfleet.lora_rank": adapter.rank})
        return _lora_reply(True, None, self.runner.lora.loaded(), pause_s=pause_s,
                           adapter_bytes=adapter.nbytes)

    async def _load_adapter(self, name: str, path: str, pinned: bool) -> tuple[Adapter, float]:
        """Reads, checks and installs an adapter (caller holds the LoRA lock); (adapter, pause seconds)."""
        if name in self.runner.lora.adapters:  # before reading anything: SGLang's message
            raise LoRALoadError(f"Failed to load LoRA adapter {name} because it is already loaded")
        refused = self._outside_store(path)  # adapters, like weights, only from under the store root
        if refused:
            raise LoRALoadError(f"Failed to load LoRA adapter {name}: {refused}")
        adapter = await asyncio.to_thread(read_adapter, path, name, self.runner.lora.linears,
                                          self.runner.vocab_size, pinned)

        def install() -> float:
            started = time.perf_counter()
            self.scheduler.install_adapter(adapter)
            return time.perf_counter() - started

        pause_s = await self._call(install)
        self._lora_refs[name] = (path, pinned)
        return adapter, pause_s

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        name = (await _body(request)).get("lora_name")
        if not isinstance(name, str) or not name:
            return _lora_reply(False, "unload_lora_adapter needs 'lora_name' (a non-empty string)")
        async with self._lora_lock:
            try:
                loaded = await self._call(lambda: self.scheduler.remove_adapter(name))
            except LoRALoadError as exc:
                return _lora_reply(False, str(exc))
        trace.get_current_span().set_attribute("rlfleet.lora_name", name)
        return _lora_reply(True, None, loaded)

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        """SGLang's same-node route: `serialized_named_tensors` holds one entry per TP rank (this engine
        has one), each a ForkingPickler pickle of [(name, tensor)] whose tensors live in the sender's
        shared memory; they are copied out, hashed (the reply's `checksums`), then swapped in."""
        body = await _body(request)
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or not entries or not all(isinstance(e, str) for e in entries):
            return _error("update_weights_from_tensor needs 'serialized_named_tensors': a list of base64 "
                          "strings, one per TP rank")
        if len(entries) != 1:
            return _error(f"serialized_named_tensors has {len(entries)} entries; this engine has TP size 1")
        load_format = body.get("load_format")
        if load_format not in (None, "direct"):
            return _weight_reply(False, f"load_format {load_format!r} is not supported by the CPU engine's "
                                        "update_weights_from_tensor; send none (direct)")
        async with self._weights_lock:
            try:
                named = await asyncio.to_thread(deserialize_tensors, entries[0])
            except TensorPayloadError as exc:
                return _weight_reply(False, str(exc))
            sums = await asyncio.to_thread(tensor_checksums, named)
            return await self._swap(named, _optional_str(body, "weight_version"), _pause_mode(request, body),
                                    checksums=sums, checksum_algorithm=DEFAULT_ALGORITHM)

    async def remote_instance_transfer_engine_info(self, request: web.Request) -> web.Response:
        """Where the P2P staging buffer lives, in SGLang's shape (`rank`, `[session_id, {name: [ptr, numel,
        element_size]}]`); the first call registers the buffer with Mooncake."""
        try:
            rank = int(request.query["rank"])
        except (KeyError, ValueError):
            return _error("remote_instance_transfer_engine_info needs the query parameter rank (a TP rank)")
        if rank != 0:
            return _error(f"rank {rank} is out of range: this engine has TP size 1")
        try:
            endpoint = await asyncio.to_thread(self.staging.endpoint)
        except P2PError as exc:
            return _error(f"peer-to-peer transfer is unavailable on this engine: {exc}", status=503)
        return web.json_response(endpoint.to_json())

    async def update_weights_from_staging(self, request: web.Request) -> web.Response:
        """rlfleet-only: the version staged by a trainer -- written into the P2P staging buffer (`source`
        p2p, the default) or received by a staged broadcast (`source` distributed) -- checked tensor by
        tensor against the trainer's `checksums`, then flipped in inside a pause of `pause_mode`; a
        partial or corrupted transfer is refused and nothing changes. `discard: true` drops a staged
        broadcast instead (its version was rejected)."""
        body = await _body(request)
        source = body.get("source", "p2p")
        if source not in STAGING_SOURCES:
            return _error(f"unknown staging source {source!r}; expected one of {', '.join(STAGING_SOURCES)}")
        if body.get("discard"):
            dropped, self._staged_broadcast = self._staged_broadcast, None
            return _weight_reply(True, "staged broadcast dropped" if dropped else "nothing was staged")
        checksums, algorithm = body.get("checksums"), body.get("checksum_algorithm", DEFAULT_ALGORITHM)
        if not isinstance(checksums, dict) or not checksums or not isinstance(algorithm, str):
            return _error("update_weights_from_staging needs 'checksums' (name -> hex digest) and "
                          "'checksum_algorithm'")
        mode = body.get("pause_mode", "retract")
        if not is_pause_mode(mode):
            return _error(f"unknown pause_mode {mode!r}; expected one of {', '.join(PAUSE_MODES)}")
        version = _optional_str(body, "weight_version")
        if source == "distributed":
            return await self._flip_broadcast(checksums, algorithm, version, mode)
        if not self.staging.ready:
            return _weight_reply(False, "nothing is staged: no trainer was given this engine's endpoint "
                                        "(GET /remote_instance_transfer_engine_info)")
        model_path = _optional_str(body, "model_path")
        ref = None
        if model_path:  # the store's copy of the version: once flipped in, the engine holds that version
            try:
                ref = self.store.locate(model_path)
            except StoreLoadError as exc:
                return _error(f"update_weights_from_staging: {exc}")
        async with self._weights_lock:
            try:
                await asyncio.to_thread(self.staging.verify, checksums, algorithm)
            except P2PError as exc:
                return _weight_reply(False, f"staged weights refused: {exc}",
                                     mismatched=getattr(exc, "names", []))
            named = self.staging.named()
            if ref is None:
                # The store may not have it yet: kept, to be adopted once it has (adopt_store_version).
                def adopt() -> str:
                    self.store.keep_sent(named, checksums, algorithm)
                    return "not in the store yet: kept to adopt"
            else:
                adopt = lambda: self.store.adopt_sent(ref, named, checksums, algorithm)  # noqa: E731
            return await self._swap(named, version, mode, adopt_store=adopt, bytes=self.staging.nbytes)

    async def adopt_store_version(self, request: web.Request) -> web.Response:
        """`{model_path, weight_version}`: the engine serves `weight_version`, flipped in from P2P staging
        before the store had it; now that the store does, the engine holds that store version when the
        checksums agree, so the next store update can be a delta. `success` false (200) says why not."""
        body = await _body(request)
        model_path, version = _optional_str(body, "model_path"), _optional_str(body, "weight_version")
        if not model_path or not version:
            return _error("adopt_store_version needs 'model_path' and 'weight_version'")
        try:
            ref = self.store.locate(model_path)
        except StoreLoadError as exc:
            return _error(f"adopt_store_version: {exc}")
        async with self._weights_lock:
            if self.scheduler.weight_version != version:
                return _weight_reply(False, f"the engine serves {self.scheduler.weight_version!r}, "
                                            f"not {version!r}")
            why = await asyncio.to_thread(self.store.adopt, ref)
        return _weight_reply(not why, why or f"holds store version {ref.version}",
                             weight_store_version=self.store.held_version)

    async def _flip_broadcast(self, checksums: dict[str, str], algorithm: str, version: str | None,
                              mode: PauseMode) -> web.Response:
        async with self._weights_lock:
            staged, self._staged_broadcast = self._staged_broadcast, None
            if staged is None:
                return _weight_reply(False, "nothing is staged: no staged broadcast arrived "
                                            "(update_weights_from_distributed?staged=1)")
            if algorithm != staged.algorithm:
                return _weight_reply(False, f"the staged broadcast was hashed with {staged.algorithm}, "
                                            f"not {algorithm}: refused")
            bad = mismatched(checksums, staged.checksums)
            if bad:
                return _weight_reply(False, f"staged weights refused: {len(bad)} tensor(s) arrived with the "
                                            f"wrong checksum: {', '.join(bad[:5])}", mismatched=bad)
            return await self._adopt(staged.prepared, version or staged.version, mode,
                                     checksums=staged.checksums, checksum_algorithm=algorithm,
                                     bytes=staged.nbytes)

    async def _swap(self, named, version: str | None, mode: PauseMode, adopt_store=None,
                    **extra) -> web.Response:
        """The one step inside the pause: the tensors (already received and checked) into the model.
        An engine already paused (by the gateway or a caller) stays paused: its pauser resumes it."""

        try:  # checked and cast to fp32 while the engine keeps generating
            prepared = await asyncio.to_thread(self.runner.prepare_weights, named)
        except WeightLoadError as exc:
            return _weight_reply(False, f"Failed to update weights: {exc}")
        return await self._adopt(prepared, version, mode, adopt_store=adopt_store, **extra)

    async def _adopt(self, prepared, version: str | None, mode: PauseMode, adopt_store=None,
                     **extra) -> web.Response:
        """The pause: each parameter takes its prepared buffer (a pointer flip). The old buffers are
        released after the resume, so freeing them is not part of the pause. `adopt_store` (after the
        resume, still under the weights lock): makes the engine hold the store's copy of what it
        now serves (`StoreWeights.adopt_sent`), so the next store update may be a delta."""
        old: list[Any] = []

        def swap() -> tuple[bool, str, float, int, str]:
            own_pause = self.scheduler.paused is None
            queued = len(self.scheduler.running) + len(self.scheduler.waiting)
            # The buffers being replaced, gathered before the pause (a `.data` per parameter is a new
            # tensor object each: ~0.1 ms at 100M that the pause need not hold).
            replaced = [self.runner.parameter(name).data for name, _ in prepared]
            started = time.perf_counter()
            if own_pause:
                self.scheduler.pause(mode)
            try:
                old.extend(replaced)
                success, message = self.scheduler.adopt_weights(prepared, version)
                if success:
                    old.append(self.store.served)  # the store's copy of the old version: freed after too
                    self.store.forget()  # no longer the exact bytes of a weight-store version
            finally:
                if own_pause:
                    self.scheduler.resume()
            return success, message, time.perf_counter() - started, queued, self.scheduler.weight_version

        success, message, swap_s, queued, served = await self._call(swap)
        await asyncio.to_thread(old.clear)
        if success and adopt_store is not None:
            why = await asyncio.to_thread(adopt_store)
            if why:
                log.warning("version %s flipped in, but the engine holds no store version: %s", served, why)
            extra = {**extra, "weight_store_version": self.store.held_version, "weight_store_note": why}
        trace.get_current_span().set_attributes(
            {"rlfleet.weight_version": served, "rlfleet.tensors": len(prepared)}
        )
        return _weight_reply(success, message, num_paused_requests=queued, pause_s=swap_s, pause_mode=mode,
                             **(extra if success else {}))

    async def _call(self, fn):
        return await asyncio.wrap_future(self.scheduler.call(fn))

    def close_groups(self) -> None:
        with self._groups_lock:
            groups, self._groups = list(self._groups.values()), {}
        for group in groups:
            try:
                distributed.leave_group(group)
            except Exception:
                log.exception("leaving a weight update group failed")


def _record_status(span: trace.Span, status: int, message: str | None = None) -> None:
    span.set_attribute("http.response.status_code", status)
    if status >= 500:  # a 4xx is the caller's error, not the server's (HTTP semantic conventions)
        span.set_status(Status(StatusCode.ERROR, message or f"HTTP {status}"))


def _describe_generation(span: trace.Span, items: list[GenerateItem], outputs: list[RequestOutput]) -> None:
    """What a generate span says about its reply: once per request, after the scheduler finished it."""
    if not span.is_recording():
        return
    waits = [out.queue_wait_s for out in outputs if out.queue_wait_s is not None]
    versions = sorted({version for out in outputs for version, _, _ in out.weight_version_spans})
    attributes: dict[str, Any] = {
        "rlfleet.requests": len(items),
        "rlfleet.input_tokens": sum(out.prompt_tokens for out in outputs),
        "rlfleet.output_tokens": sum(len(out.output_ids) for out in outputs),
        # One reason for one request; the distinct reasons, sorted, for a batch.
        "rlfleet.finish_reason": ",".join(sorted({str(out.finish_reason.get("type")) for out in outputs})),
        # The version the reply reports (the one served at its end), and every version that produced
        # some of its tokens (more than one when a weight update landed mid-generation).
        "rlfleet.weight_version": ",".join(sorted({out.weight_version for out in outputs})),
        "rlfleet.weight_versions": versions,
        "rlfleet.retractions": sum(out.retractions for out in outputs),
    }
    if waits:
        attributes["rlfleet.queue_wait_s"] = max(waits)
    if len(items) == 1:
        attributes["rlfleet.rid"] = items[0].rid
    span.set_attributes(attributes)


def _result(item: GenerateItem, out: RequestOutput) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": out.rid,
        "finish_reason": out.finish_reason,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": len(out.output_ids),
        "cached_tokens": out.cached_tokens,
        "weight_version": out.weight_version,
        # SGLang 0.5.23: which weight version produced which output tokens, [start, end); a reply
        # with no output tokens has one empty range of the version it saw.
        "weight_versions": [{"version": version, "start": start, "end": end}
                            for version, start, end in out.weight_version_spans]
        or [{"version": out.weight_version, "start": 0, "end": 0}],
        "e2e_latency": out.e2e_latency,
    }
    if item.return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tok, None] for lp, tok in zip(out.output_logprobs, out.output_ids, strict=True)
        ]
        meta["input_token_logprobs"] = [[lp, tok, None] for lp, tok in out.input_logprobs]
    return {"text": out.text, "output_ids": out.output_ids, "meta_info": meta}


MAX_REQUEST_BYTES = web.AppKey("max_request_bytes", int)


async def _body(request: web.Request, max_bytes: int | None = None) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        data = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        limit = max_bytes or request.app.get(MAX_REQUEST_BYTES)
        error = {"message": f"the request body is larger than the engine's max_request_bytes ({limit})",
                 "field": "body", "limit": limit}
        raise web.HTTPRequestEntityTooLarge(max_size=limit or 0, actual_size=request.content_length or 0,
                                            text=json.dumps({"error": error}),
                                            content_type="application/json") from exc
    try:
        body = json.loads(data or b"{}")
    except (ValueError, RecursionError) as exc:
        # RecursionError: JSON nested deeper than Python's stack (`[[[[...`) is bad input, not a 500.
        why = "nested too deeply" if isinstance(exc, RecursionError) else clip(str(exc))
        _log_bad_body(request, why)
        raise web.HTTPBadRequest(
            text=json.dumps({"error": {"message": f"invalid JSON: {why}", "field": "body"}}),
            content_type="application/json",
        ) from None
    if request.path != "/generate" and not isinstance(body, dict):
        raise web.HTTPBadRequest(
            text=json.dumps({"error": {"message": "the body must be a JSON object"}}),
            content_type="application/json",
        )
    return body


def _pause_mode(request: web.Request, body: dict) -> PauseMode:
    """abort when SGLang's `abort_all_requests` says so; else the rlfleet-only query parameter
    `pause_mode` (SGLang's bodies have no such field, so the broker sends it to CPU engines this way);
    else in_place: the swap runs between two decode steps and running requests carry on."""
    if body.get("abort_all_requests"):
        return "abort"
    mode = request.query.get("pause_mode", "in_place")
    if not is_pause_mode(mode):
        raise web.HTTPBadRequest(text=json.dumps({"error": {"message": f"unknown pause_mode {mode!r}; "
                                                            f"expected one of {', '.join(PAUSE_MODES)}"}}),
                                 content_type="application/json")
    return mode


_BAD_BODIES = OncePerPeer(interval_s=60.0)


def _log_bad_body(request: web.Request, why: str) -> None:
    """One line per peer per minute, however many undecodable bodies it sends."""
    peer = request.remote or "?"
    first, suppressed = _BAD_BODIES.should_log(peer)
    if first:
        log.warning("undecodable request body", extra={"peer": peer, "path": request.path, "why": why,
                                                       "suppressed_since_last": suppressed})


def _optional_str(body: dict, key: str) -> str | None:
    value = body.get(key)
    return None if value is None else str(value)


def _error(message: str, status: int = 400, **details: Any) -> web.Response:
    """An error reply; its message never echoes a large input whole (errors.clip)."""
    return web.json_response({"error": {"message": clip(message, 600), **details}}, status=status)


def _lora_reply(success: bool, error_message: str | None, loaded: dict[str, str] | None = None,
                **extra) -> web.Response:
    """SGLang's LoRAUpdateOutput (success, error_message, loaded_adapters): 200, or 400 on failure."""
    span = trace.get_current_span()
    if not success and span.is_recording():
        span.set_status(Status(StatusCode.ERROR, error_message or "LoRA update failed"))
    body = {"success": success, "error_message": error_message, "loaded_adapters": loaded, **extra}
    return web.json_response(body, status=200 if success else 400)


def _weight_reply(success: bool, message: str, http_status: int | None = None, /, **extra) -> web.Response:
    span = trace.get_current_span()
    if span.is_recording():
        # The reply's numbers and names (version, load format, pause, bytes, ...) describe the update.
        span.set_attribute("rlfleet.success", success)
        span.set_attributes(
            {
                f"rlfleet.{key}": value
                for key, value in extra.items()
                if isinstance(value, str | int | float | bool)
            }
        )
        if not success:
            span.set_status(Status(StatusCode.ERROR, message))
    return web.json_response(
        {"success": success, "message": message, **extra}, status=http_status or (200 if success else 400)
    )


async def serve(config: EngineConfig) -> None:
    """Sets up telemetry, loads the model, starts the scheduler thread and serves until SIGTERM/SIGINT."""
    telemetry = setup_telemetry(SERVICE_NAME, config.telemetry, config.metrics)
    try:
        await _serve(config, telemetry.metrics_port)
    finally:
        # Last, so the spans of requests ended by the shutdown are exported too; bounded by the
        # export timeout, so a missing collector never holds the exit up.
        telemetry.shutdown(config.telemetry.export_timeout_s)


def secure_config(config: EngineConfig) -> None:
    """An engine serves only with its API keys (the run's, where none is given) and a weight store
    root: without them anyone could drive it or make it load any file on the host."""
    api, admin = engine_keys()
    config.api_key = config.api_key or api or None
    config.admin_api_key = config.admin_api_key or admin or None
    if not (config.api_key and config.admin_api_key):
        raise StartupError("an engine needs --api-key and --admin-api-key (or the run's secrets directory, "
                           "RLFLEET_SECRETS_DIR, which holds the run's engine keys)")
    if config.weight_store_root is None:
        raise StartupError("an engine needs --weight-store-root: weight loads are allowed only from under it")


async def _serve(config: EngineConfig, metrics_port: int) -> None:
    import torch

    secure_config(config)

    torch.set_num_threads(config.torch_threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set in this process
    assert config.model_path is not None  # rlfleet.engine.main.serve refuses a config without one
    runner = await asyncio.to_thread(ModelRunner, config.model_path, config.dtype)
    scheduler = Scheduler(
        runner,
        max_running_requests=config.max_running_requests,
        max_total_tokens=config.max_total_tokens,
        max_prefill_tokens=config.max_prefill_tokens,
        max_prefix_cache_tokens=config.max_prefix_cache_tokens,
        weight_version=config.weight_version,
    )
    server = EngineServer(config, runner, scheduler)
    scheduler.start()
    app_runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await app_runner.setup()
    site = web.TCPSite(app_runner, config.host, config.port)
    await site.start()
    port = app_runner.addresses[0][1]  # the real port when config.port == 0
    url = f"http://{config.host}:{port}"
    if config.ready_file:
        write_ready_file(
            config.ready_file,
            {
                "url": url,
                "port": port,
                "pid": os.getpid(),
                "engine_id": server.engine_id,
                "metrics_port": metrics_port,
            },
        )
    log.info("cpu engine %s serving %s at %s", server.engine_id, config.model_path, url)
    stop = stop_on_signals()
    try:
        await stop.wait()
    finally:
        log.info("cpu engine %s stopping", server.engine_id)
        scheduler.stop()
        await app_runner.cleanup()
        server.close_groups()

