"""Continuous batching: one thread owns the model, the running batch and its KV cache.

Each iteration of the loop (`step`):
  1. takes newly submitted requests into the waiting queue and runs queued control commands
     (abort, pause/continue, weight swaps, flush) -- so those only ever happen between steps;
  2. unless paused, admits waiting requests while they fit (`max_running_requests`, the
     `max_total_tokens` KV budget, `max_prefill_tokens` per step), prefills them together in one
     forward pass (one each only when input log-probs are wanted) and samples their first tokens;
     their KV then joins the running batch (`PaddedKVCache.extend`). A prefill starts from the
     longest prefix the prefix cache holds and feeds only the rest;
  3. decodes one token for every running request in a single batched forward, and lets finished
     requests leave the batch: their KV (prompt + output but the last token) goes to the prefix
     cache, then their cache rows are dropped and shared padding trimmed.

The prefix cache (`prefix_cache.py`) keeps the KV of finished requests, so the next turn of a
multi-turn episode (the previous prompt + output + an observation) or another episode with the same
system prompt does not prefill those tokens again; `cached_tokens` in a reply says how many it
reused. It is skipped for requests that want input log-probs (those need the logits of every prompt
position), emptied on `flush_cache`, and emptied whenever the weights change (`weight_epoch`); a
request whose KV spans a weight change (it ran across an in-place swap) is not stored.

Sampling is per request (`sampling.py`): a request's tokens depend on its own seed and prompt,
not on the batch it shares. Log-probs are `log_softmax` of the raw fp32 logits (temperature 1,
before top-k/top-p). Pause modes follow SGLang: `abort` ends every request with what it has,
`retract` drops the running requests' KV and puts them back at the head of the queue (recomputed
by a prefill over prompt + output so far after `continue`, so their output is what it would have
been), `in_place` freezes the batch with its KV. Every output token records the weight version
that produced it; a reply reports the version at its end and the spans.

LoRA (`lora.py`): a request may name a loaded adapter; it keeps that adapter from admission to the
end (an unload only stops new requests from using it), every forward pass applies each row's own
adapter, so a batch mixes adapters and the base model, and its tokens' versions are the adapter's
name. Its prefix-cache entries are its adapter's (looked up and stored under the adapter's load id).
Loading and unloading are scheduler commands too: a dict update between two steps.

Other threads talk to the scheduler only through `submit` and `call`; torch releases the GIL in
the forward passes, so the HTTP event loop stays responsive while the loop runs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal, TypeGuard

import torch

from rlfleet.engine.kv_cache import PaddedKVCache
from rlfleet.engine.lora import Adapter
from rlfleet.engine.model_runner import ModelRunner, WeightLoadError
from rlfleet.engine.prefix_cache import PrefixCache, PrefixHit
from rlfleet.engine.protocol import GenerateItem
from rlfleet.engine.sampling import RowSampler, make_generator, sample

log = logging.getLogger(__name__)

PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES = ("abort", "retract", "in_place")


def is_pause_mode(value: object) -> TypeGuard[PauseMode]:
    """Whether a mode a caller sent is one the scheduler takes (and, to mypy, a PauseMode from here)."""
    return value in PAUSE_MODES


@dataclass
class RequestOutput:
    rid: str
    text: str
    output_ids: list[int]
    output_logprobs: list[float]
    input_logprobs: list[tuple[float | None, int]]
    finish_reason: dict[str, Any]
    prompt_tokens: int
    weight_version: str
    weight_version_spans: list[tuple[str, int, int]]
    e2e_latency: float
    retractions: int
    queue_wait_s: float | None = None  # from submit to the batch's first pickup; None: never picked up
    cached_tokens: int = 0  # prompt tokens whose KV the first prefill took from the prefix cache


class Request:
    """A generate request's state in the scheduler; everything below is touched by its thread only."""

    def __init__(
        self, item: GenerateItem, eos_token_ids: frozenset[int], on_done: Callable[[RequestOutput], object],
        adapter: Adapter | None = None,
    ):
        spec = item.sampling
        self.item = item
        self.adapter = adapter  # the LoRA adapter it runs with, held until it finishes; None: the base model
        self.rid = item.rid
        self.prompt_ids = list(item.input_ids)
        self.spec = spec
        self.sampler = RowSampler(
            spec.temperature, spec.top_p, spec.top_k, make_generator(spec.sampling_seed)
        )
        self.stop_ids = set(spec.stop_token_ids) | (set() if spec.ignore_eos else set(eos_token_ids))
        self.on_done = on_done
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.versions: list[str] = []
        self.input_logprobs: list[tuple[float | None, int]] | None = None
        self.finish_reason: dict[str, Any] | None = None
        self.created = time.monotonic()
        self.admitted: float | None = None  # first admission into the running batch (not re-admissions)
        self.retractions = 0
        self.checked_chars = 0  # output text already searched for stop strings
        self.cached_tokens = 0
        self.kv_epoch = -1  # the runner's weight_epoch at its last prefill: its KV belongs to those weights

    @property
    def reserved_tokens(self) -> int:
        return len(self.prompt_ids) + self.spec.max_new_tokens


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        max_running_requests: int = 64,
        max_total_tokens: int = 65536,
        max_prefill_tokens: int = 4096,
        max_prefix_cache_tokens: int = 32768,
        weight_version: str = "default",
    ) -> None:
        self.runner = runner
        self.max_running_requests = max_running_requests
        self.max_total_tokens = max_total_tokens
        self.max_prefill_tokens = max_prefill_tokens
        self.weight_version = weight_version
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.cache = PaddedKVCache(runner.num_layers, rows=0)
        self.prefix_cache = PrefixCache(max_prefix_cache_tokens)
        self._prefix_epoch = runner.weight_epoch  # the weights the prefix cache's KV belongs to
        self.paused: PauseMode | None = None
        self.decode_steps = 0
        self.prefill_passes = 0
        self.prefill_rows_shared = 0  # batched requests that took another's identical prefill row
        self.generated_tokens = 0
        self._prefilling: list[Request] = []  # admitted this step, not yet delivered or running
        self._inbox: deque[Request] = deque()
        self._commands: deque[tuple[Callable[[], Any], Future]] = deque()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # --- thread-safe entry points ---------------------------------------------------------------
    def submit(self, request: Request) -> None:
        self._inbox.append(request)
        self._wake.set()

    def call(self, fn: Callable[[], Any]) -> Future:
        """Runs `fn` on the scheduler thread between two steps; the future holds its result."""
        future: Future = Future()
        self._commands.append((fn, future))
        self._wake.set()
        return future

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run_forever, name="engine-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # --- the loop -------------------------------------------------------------------------------
    def _run_forever(self) -> None:
        while not self._stopping.is_set():
            try:
                worked = self.step()
            except Exception as exc:  # a model error must not kill the thread and hang every client
                log.exception("scheduler step failed")
                self._fail_running(f"engine error: {exc}")
                worked = False
            if not worked:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
        self.abort(abort_all=True, message="engine shutting down")

    def step(self) -> bool:
        """One scheduling iteration; returns whether it did model work."""
        while self._inbox:
            self.waiting.append(self._inbox.popleft())
        while self._commands:
            fn, future = self._commands.popleft()
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)
        self._drop_stale_prefixes()  # a command may have changed the weights
        if self.paused is not None:
            return False
        admitted = self._admit()
        self._prefilling = admitted  # failed with the running batch if a forward pass raises
        batched = [r for r in admitted if not _wants_input_logprobs(r) and r.spec.max_new_tokens > 0]
        if len(batched) < 2:
            batched = []
        for request in admitted:
            if request not in batched:
                self._prefill(request)
        if batched:
            self._prefill_batch(batched)
        self._prefilling = []
        if self.running:
            self._decode()
        return bool(admitted or self.running)

    def _admit(self) -> list[Request]:
        admitted: list[Request] = []
        budget = self.max_total_tokens - sum(r.reserved_tokens for r in self.running)
        prefill_budget = self.max_prefill_tokens
        while self.waiting and len(self.running) + len(admitted) < self.max_running_requests:
            request = self.waiting[0]
            prefill = len(request.prompt_ids) + len(request.output_ids)
            if request.reserved_tokens > budget or (admitted and prefill > prefill_budget):
                break  # FIFO: later requests do not overtake one that does not fit yet
            admitted.append(self.waiting.popleft())
            if request.admitted is None:
                request.admitted = time.monotonic()
            budget -= request.reserved_tokens
            prefill_budget -= prefill
        return admitted

    def _prefill(self, request: Request) -> None:
        # After a retract the output so far is recomputed with the prompt; its last logits give
        # the next token exactly as the interrupted decode step would have.
        tokens = request.prompt_ids + request.output_ids
        want_input = _wants_input_logprobs(request)
        cached = None if want_input else self._cached_prefix(tokens, request.reserved_tokens, request.adapter)
        if request.retractions == 0:
            request.cached_tokens = 0 if cached is None else cached.length
        logits, cache = self.runner.prefill(tokens, all_logits=want_input, cached=cached,
                                            adapter=request.adapter)
        self.prefill_passes += 1
        request.kv_epoch = self.runner.weight_epoch
        if want_input:
            request.input_logprobs = _input_logprobs(
                logits, request.prompt_ids, request.item.logprob_start_len
            )
        if request.spec.max_new_tokens == 0:
            request.finish_reason = {"type": "length", "length": 0}
            self._remember(request, *cache.row(0))
            self._deliver(request)
            return
        tokens_out, logprobs = sample(logits[-1:], [request.sampler])
        if self._append(request, tokens_out[0], logprobs[0]):
            self._remember(request, *cache.row(0))
            self._deliver(request)
            return
        self.cache.extend(cache)
        self.running.append(request)

    def _prefill_batch(self, requests: list[Request]) -> None:
        """Prefills several requests in one forward pass: on a small model a pass costs about the
        same for one row as for many, so one pass per admitted request is what prefill time was.

        Each row feeds the same number of tokens Q (the longest uncached suffix): a row with a shorter
        suffix feeds the last tokens of its cached prefix again instead of padding between its KV and
        its new tokens, and a row shorter than Q in all is left-padded, so the batch keeps the
        running cache's layout (each row's tokens contiguous, ending at the same column).

        Requests with the same tokens under the same adapter (a GRPO group's samples of one prompt,
        admitted together) are prefilled once: their rows of the pass's KV and logits are copies of
        that one row, which is what each would have computed (SGLang's radix cache shares a running
        prefix the same way); each then samples on its own."""
        plans: list[tuple[Request, list[int], int, PrefixHit | None]] = []
        first: dict[tuple[str | None, tuple[int, ...]], int] = {}  # what a plan computes -> its index
        source = []  # per request: the plan whose row it takes
        for request in requests:
            tokens = request.prompt_ids + request.output_ids
            key = (_namespace(request.adapter), tuple(tokens))
            if key not in first:
                first[key] = len(plans)
                hit = self._prefix_hit(tokens, request.adapter)
                plans.append((request, tokens, 0 if hit is None else hit.length, hit))
            source.append(first[key])
        fed = max(len(tokens) - reused for _, tokens, reused, _ in plans)
        kept = [max(0, len(tokens) - fed) for _, tokens, _, _ in plans]  # cached columns each row keeps
        logits, cache = self.runner.prefill_rows(
            [tokens for _, tokens, _, _ in plans],
            [None if keep == 0 or hit is None else (hit.keys, hit.values)
             for (_, _, _, hit), keep in zip(plans, kept, strict=True)],
            kept,
            fed,
            [request.adapter for request, _, _, _ in plans],
        )
        self.prefill_passes += 1
        self.prefill_rows_shared += len(requests) - len(plans)
        if len(plans) < len(requests):
            logits = logits.index_select(0, torch.tensor(source, dtype=torch.long))
            cache.keep_rows(source)
        tokens_out, logprobs = sample(logits, [request.sampler for request in requests])
        keep_rows, staying = [], []
        for row, request in enumerate(requests):
            if request.retractions == 0:
                request.cached_tokens = kept[source[row]]
            request.kv_epoch = self.runner.weight_epoch
            if self._append(request, tokens_out[row], logprobs[row]):
                self._remember(request, *cache.row(row))
                self._deliver(request)
            else:
                keep_rows.append(row)
                staying.append(request)
        if staying:
            cache.keep_rows(keep_rows)
            self.cache.extend(cache)
            self.running.extend(staying)

    def _decode(self) -> None:
        logits = self.runner.decode(self.cache, [r.output_ids[-1] for r in self.running],
                                    [r.adapter for r in self.running])
        tokens, logprobs = sample(logits, [r.sampler for r in self.running])
        self.decode_steps += 1
        keep: list[int] = []
        done: list[int] = []
        for row, request in enumerate(self.running):
            (done if self._append(request, tokens[row], logprobs[row]) else keep).append(row)
        if done:
            finished = [self.running[row] for row in done]
            for row in done:  # before keep_rows drops them
                self._remember(self.running[row], *self.cache.row(row))
            self.running = [self.running[row] for row in keep]
            self.cache.keep_rows(keep)
            for request in finished:
                self._deliver(request)

    def _append(self, request: Request, token: int, logprob: float) -> bool:
        """Records a sampled token; returns whether the request is now finished."""
        request.output_ids.append(token)
        request.output_logprobs.append(logprob)
        request.versions.append(self.weight_version if request.adapter is None else request.adapter.name)
        self.generated_tokens += 1
        if token in request.stop_ids:
            request.finish_reason = {"type": "stop", "matched": token}
        elif request.spec.stop and (matched := self._matched_stop_string(request)) is not None:
            request.finish_reason = {"type": "stop", "matched": matched}
        elif len(request.output_ids) >= request.spec.max_new_tokens:
            request.finish_reason = {"type": "length", "length": request.spec.max_new_tokens}
        return request.finish_reason is not None

    def _matched_stop_string(self, request: Request) -> str | None:
        text = self.runner.decode_text(request.output_ids, request.spec.skip_special_tokens)
        # Only text that grew since the last check can hold a new match; the margin also covers a
        # trailing partial UTF-8 character that decoded differently last time.
        start = max(0, request.checked_chars - max(len(s) for s in request.spec.stop) - 4)
        request.checked_chars = len(text)
        window = text[start:]
        for stop in request.spec.stop:
            if stop in window:
                return stop
        return None

    # --- control (run on the scheduler thread through `call`) -----------------------------------
    def pause(self, mode: PauseMode) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}; expected one of {', '.join(PAUSE_MODES)}")
        if mode == "abort":
            self.abort(abort_all=True, message="aborted by pause_generation(mode=abort)")
        elif mode == "retract":
            self._retract_all()
        self.paused = mode

    def resume(self) -> None:
        self.paused = None

    def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "aborted") -> int:
        """Ends matching waiting and running requests with finish reason abort; returns how many."""
        hit = lambda r: abort_all or r.rid == rid  # noqa: E731
        while self._inbox:
            self.waiting.append(self._inbox.popleft())
        aborted = [r for r in self.waiting if hit(r)]
        self.waiting = deque(r for r in self.waiting if not hit(r))
        keep = [row for row, r in enumerate(self.running) if not hit(r)]
        if len(keep) < len(self.running):
            aborted += [r for r in self.running if hit(r)]
            self.running = [self.running[row] for row in keep]
            self.cache.keep_rows(keep)
        for request in aborted:
            request.finish_reason = {"type": "abort", "message": message}
            self._deliver(request)
        return len(aborted)

    def flush_cache(self) -> tuple[bool, str]:
        # As SGLang's: refused while the running batch holds KV (a flush may not pull it from under
        # requests frozen by an in-place pause), else the prefix cache is emptied.
        if self.running:
            return False, (
                f"cannot flush the cache while {len(self.running)} requests hold KV in the running batch "
                "(paused in place?); continue or pause with mode abort/retract first"
            )
        self.prefix_cache.clear()
        return True, "Cache flushed."

    def update_weights(
        self,
        named: list[tuple[str, torch.Tensor]],
        weight_version: str | None = None,
        abort_all: bool = False,
    ) -> tuple[bool, str]:
        if abort_all:
            self.abort(abort_all=True, message="aborted for a weight update")
        try:
            count = self.runner.load_weights(named)
        except WeightLoadError as exc:
            return False, f"Failed to update weights: {exc}"
        self._drop_stale_prefixes()
        if weight_version is not None:
            self.weight_version = weight_version
        return True, f"Succeeded to update model weights ({count} tensors, version {self.weight_version})."

    def install_adapter(self, adapter: Adapter) -> dict[str, str]:
        """Serves a LoRA adapter read beforehand (off this thread); returns the loaded adapters."""
        self.runner.lora.install(adapter)
        return self.runner.lora.loaded()

    def remove_adapter(self, name: str) -> dict[str, str]:
        """Unloads an adapter: new requests can no longer name it, running ones finish with it; its
        prefix-cache entries go (no later lookup could match them)."""
        adapter = self.runner.lora.remove(name)
        self.prefix_cache.drop(adapter.lora_id)
        return self.runner.lora.loaded()

    def adopt_weights(self, prepared: list[tuple[str, torch.Tensor]], weight_version: str | None = None
                      ) -> tuple[bool, str]:
        """`update_weights` for tensors the runner prepared outside the pause (`prepare_weights`)."""
        count = self.runner.adopt_weights(prepared)
        self._drop_stale_prefixes()
        if weight_version is not None:
            self.weight_version = weight_version
        return True, f"Succeeded to update model weights ({count} tensors, version {self.weight_version})."

    def set_weight_version(self, version: str, abort_all: bool = False) -> None:
        if abort_all:
            self.abort(abort_all=True, message="aborted by update_weight_version")
        self.weight_version = version

    def load(self) -> dict[str, Any]:
        return {
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting) + len(self._inbox),
            "num_tokens": sum(len(r.prompt_ids) + len(r.output_ids) for r in self.running),
            "paused": self.paused,
            "weight_version": self.weight_version,
            "decode_steps": self.decode_steps,
            "prefill_passes": self.prefill_passes,
            "prefill_rows_shared": self.prefill_rows_shared,
            "generated_tokens": self.generated_tokens,
            "prefix_cache_tokens": self.prefix_cache.tokens,
            "prefix_cache_lookups": self.prefix_cache.lookups,
            "prefix_cache_hits": self.prefix_cache.hits,
            "prefix_cache_hit_tokens": self.prefix_cache.hit_tokens,
        }

    # --- internals ------------------------------------------------------------------------------
    def _prefix_hit(self, tokens: list[int], adapter: Adapter | None) -> PrefixHit | None:
        self._drop_stale_prefixes()
        return self.prefix_cache.lookup(tokens, _namespace(adapter))

    def _cached_prefix(self, tokens: list[int], reserved: int,
                       adapter: Adapter | None) -> PaddedKVCache | None:
        """A one-row cache holding the longest prefix of `tokens` cached under `adapter`, or None."""
        hit = self._prefix_hit(tokens, adapter)
        if hit is None:
            return None
        # Room for the whole sequence up to max_new_tokens (bounded), so decoding it alone does not
        # copy the buffer again right away.
        capacity = max(len(tokens), min(reserved, max(2 * len(tokens), 64)))
        return PaddedKVCache.from_prefix(hit.keys, hit.values, capacity)

    def _remember(self, request: Request, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Offers a finished request's KV to the prefix cache: it covers prompt + output but the last
        token (sampled, never fed)."""
        self._drop_stale_prefixes()
        if not self.prefix_cache.enabled or request.kv_epoch != self.runner.weight_epoch:
            return  # part of its KV was computed by weights that are gone
        tokens = request.prompt_ids + request.output_ids[:-1]
        if keys[0].shape[2] != len(tokens):
            log.warning(
                "KV of %s covers %d tokens, not %d; not cached", request.rid, keys[0].shape[2], len(tokens)
            )
            return
        self.prefix_cache.insert(tokens, keys, values, _namespace(request.adapter))

    def _drop_stale_prefixes(self) -> None:
        if self._prefix_epoch != self.runner.weight_epoch:
            self.prefix_cache.clear()
            self._prefix_epoch = self.runner.weight_epoch

    def _retract_all(self) -> None:
        for request in self.running:
            request.retractions += 1
        self.waiting.extendleft(reversed(self.running))
        self.running = []
        self.cache = PaddedKVCache(self.runner.num_layers, rows=0)

    def _fail_running(self, message: str) -> None:
        running = set(map(id, self.running))
        admitted = [r for r in self._prefilling if r.finish_reason is None and id(r) not in running]
        failed, self.running, self._prefilling = self.running + admitted, [], []
        self.cache = PaddedKVCache(self.runner.num_layers, rows=0)
        for request in failed:
            request.finish_reason = {"type": "abort", "message": message, "status_code": 500}
            self._deliver(request)

    def _deliver(self, request: Request) -> None:
        try:
            request.on_done(self._output(request))
        except Exception:
            log.exception("delivering the result of %s failed", request.rid)

    def _output(self, request: Request) -> RequestOutput:
        finish = request.finish_reason or {"type": "abort", "message": "unfinished"}
        matched = finish.get("matched")
        trim = not request.spec.no_stop_trim
        # SGLang trims a matched stop token / stop string from the text, never from output_ids.
        text_ids = request.output_ids[:-1] if trim and isinstance(matched, int) else request.output_ids
        text = self.runner.decode_text(text_ids, request.spec.skip_special_tokens)
        if trim and isinstance(matched, str) and (cut := text.find(matched)) >= 0:
            text = text[:cut]
        return RequestOutput(
            rid=request.rid,
            text=text,
            output_ids=list(request.output_ids),
            output_logprobs=list(request.output_logprobs),
            input_logprobs=request.input_logprobs or [],
            finish_reason=finish,
            prompt_tokens=len(request.prompt_ids),
            weight_version=self.weight_version,
            weight_version_spans=_spans(request.versions),
            e2e_latency=time.monotonic() - request.created,
            retractions=request.retractions,
            cached_tokens=request.cached_tokens,
            queue_wait_s=None if request.admitted is None else request.admitted - request.created,
        )


def _namespace(adapter: Adapter | None) -> str | None:
    """The prefix cache's namespace of KV computed with `adapter`: its load id (None: the base model)."""
    return None if adapter is None else adapter.lora_id


def _wants_input_logprobs(request: Request) -> bool:
    """Input log-probs asked for and not computed yet: its prefill needs every prompt position's logits,
    so it neither reuses a cached prefix nor shares a batched pass."""
    item = request.item
    return item.return_logprob and item.logprob_start_len >= 0 and request.input_logprobs is None


def _input_logprobs(logits: torch.Tensor, prompt: list[int], start: int) -> list[tuple[float | None, int]]:
    """SGLang's input_token_logprobs from `start`: the first prompt token has no logprob."""
    logprobs = torch.log_softmax(logits[: len(prompt) - 1].float(), dim=-1)
    targets = torch.tensor(prompt[1:])
    picked = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    values: list[float | None] = [None, *picked]
    return [(values[i], prompt[i]) for i in range(start, len(prompt))]


def _spans(versions: list[str]) -> list[tuple[str, int, int]]:
    """Run-length encoding of the per-token weight versions: (version, start, end) over output tokens."""
    spans: list[tuple[str, int, int]] = []
    for index, version in enumerate(versions):
        if spans and spans[-1][0] == version:
            spans[-1] = (version, spans[-1][1], index + 1)
        else:
            spans.append((version, index, index + 1))
    return spans
