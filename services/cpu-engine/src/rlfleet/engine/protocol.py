"""Parsing and validation of SGLang's `/generate` request (`GenerateReqInput` + `SamplingParams`).

Field names, defaults and leniency follow SGLang: `null` means "use the default", unknown top-level
fields are ignored, `max_new_tokens` defaults to 128 and may be 0, `top_k = -1` is the whole
vocabulary, `temperature = 0` is greedy, `sampling_seed` seeds the request; a default
`max_new_tokens` is capped to the room the context leaves, an explicit one that does not fit is
refused. Where the CPU engine
cannot honour a field SGLang knows (penalties, grammars, `n > 1`, streaming...), a non-default
value is rejected with a message rather than silently ignored; an unknown sampling parameter is
rejected like SGLang's `SamplingParams(**kwargs)` does. Everything here raises `BadRequest`, which
the server turns into HTTP 400 with the message.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any


class BadRequest(ValueError):
    """A request the engine will not run; the message says what to fix. `status` is the HTTP status
    (400, or 413 for an input over a size limit) and `details` go into the error body beside the
    message (`field`, `limit`, `size`)."""

    def __init__(self, message: str, *, status: int = 400, **details: Any) -> None:
        super().__init__(message)
        self.status, self.details = status, details


# Text beyond this is refused before it is tokenized (tokenizing is the expensive part: about 4 s
# for a million characters of the default tokenizer on one core).
DEFAULT_MAX_TEXT_CHARS = 1_000_000


@dataclass(frozen=True)
class SamplingSpec:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None


@dataclass(frozen=True)
class GenerateItem:
    rid: str
    input_ids: list[int]
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    return_logprob: bool = False
    logprob_start_len: int = -1
    lora_path: str | None = None  # the name of a loaded LoRA adapter (SGLang's field); None: the base model


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    context_length: int
    max_total_tokens: int
    max_text_chars: int = DEFAULT_MAX_TEXT_CHARS  # characters of `text`, all prompts of a request together


def check_input_size(body: Any, limits: Limits) -> None:
    """The size checks that need no tokenizing, cheap enough for the event loop: `text` against
    max_text_chars (413), `input_ids` rows against the context length (400), before any other work."""
    if not isinstance(body, dict):
        return
    text, ids = body.get("text"), body.get("input_ids")
    texts = [text] if isinstance(text, str) else text if isinstance(text, list) else []
    chars = sum(len(t) for t in texts if isinstance(t, str))
    if chars > limits.max_text_chars:
        raise BadRequest(
            f"'text' has {chars} characters, more than the engine's max_text_chars "
            f"({limits.max_text_chars}); "
            "it was not tokenized", status=413, field="text", limit=limits.max_text_chars, size=chars)
    if isinstance(ids, list):
        rows = ids if ids and all(isinstance(r, list) for r in ids) else [ids]
        for i, row in enumerate(rows):
            if len(row) >= limits.context_length:
                where = f"input_ids[{i}]" if rows is ids else "input_ids"
                raise BadRequest(
                    f"the input ({len(row)} tokens, {where}) is longer than the model's context length "
                    f"({limits.context_length} tokens)", field=where,
                    limit=limits.context_length, size=len(row))


# SGLang sampling parameters the CPU engine does not implement, with the value that means "off".
_UNSUPPORTED_SAMPLING = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "logit_bias": None,
    "custom_params": None,
}
# Accepted and without effect here (they only shape streaming or detokenisation spacing).
_IGNORED_SAMPLING = {"stream_interval", "spaces_between_special_tokens"}
_SUPPORTED_SAMPLING = {f for f in SamplingSpec.__dataclass_fields__} | {"n"}

# Top-level GenerateReqInput fields that would change the result if honoured; rejected when set.
_UNSUPPORTED_TOP_LEVEL = (
    "input_embeds",
    "image_data",
    "video_data",
    "audio_data",
    "session_params",
    "custom_logit_processor",
    "return_hidden_states",
    "token_ids_logprob",
    "stream",
)


def parse_generate(
    body: Any, limits: Limits, encode: Callable[[str], list[int]]
) -> tuple[list[GenerateItem], bool]:
    """Returns (items, is_batch). A batch answers with a list, a single request with one object."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object (SGLang GenerateReqInput)")
    for name in _UNSUPPORTED_TOP_LEVEL:
        if body.get(name) not in (None, False, [], {}):
            raise BadRequest(f"'{name}' is not supported by the CPU engine")
    top = body.get("top_logprobs_num")
    if any(v not in (None, 0) for v in (top if isinstance(top, list) else [top])):
        raise BadRequest("'top_logprobs_num' > 0 is not supported by the CPU engine")
    check_input_size(body, limits)
    prompts, is_batch = _prompts(body, encode)
    count = len(prompts)
    sampling = _per_item(body.get("sampling_params"), count, "sampling_params", dict)
    return_logprob = _per_item(body.get("return_logprob"), count, "return_logprob", bool)
    start_len = _per_item(body.get("logprob_start_len"), count, "logprob_start_len", int)
    rids = _rids(body.get("rid"), count, is_batch)
    loras = _per_item(body.get("lora_path"), count, "lora_path", str)
    items = []
    for i, ids in enumerate(prompts):
        where = f"input_ids[{i}]" if is_batch else "input_ids"
        _check_ids(ids, limits.vocab_size, where)
        params = sampling[i] or {}
        spec = parse_sampling(params, where)
        if params.get("max_new_tokens") is None:
            # SGLang checks only an explicit max_new_tokens; the default is capped to what fits.
            room = min(limits.context_length, limits.max_total_tokens) - len(ids)
            spec = replace(spec, max_new_tokens=max(0, min(spec.max_new_tokens, room)))
        _check_length(len(ids), spec.max_new_tokens, limits, where)
        start = -1 if start_len[i] is None else start_len[i]
        if start < -1 or start >= len(ids):
            raise BadRequest(f"logprob_start_len must be -1 or in [0, {len(ids)}) for {where}; got {start}")
        if loras[i] == "":
            raise BadRequest(f"lora_path for {where} is empty; name a loaded adapter or leave it out")
        items.append(GenerateItem(rids[i], ids, spec, bool(return_logprob[i]), start, loras[i]))
    return items, is_batch


def parse_sampling(params: dict[str, Any], where: str = "input_ids") -> SamplingSpec:
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be an object")
    values: dict[str, Any] = {}
    for name, value in params.items():
        if value is None or name in _IGNORED_SAMPLING:
            continue  # SGLang: null means "use the default"
        if name in _UNSUPPORTED_SAMPLING:
            if value != _UNSUPPORTED_SAMPLING[name]:
                raise BadRequest(f"sampling parameter '{name}' is not supported by the CPU engine")
            continue
        if name == "seed":
            raise BadRequest("unknown sampling parameter 'seed'; SGLang calls it 'sampling_seed'")
        if name not in _SUPPORTED_SAMPLING:
            raise BadRequest(f"unknown sampling parameter '{name}'")
        values[name] = value
    n = _int(values.pop("n", 1), "n")
    if n != 1:
        raise BadRequest(
            f"sampling_params.n = {n}: only n = 1 is supported by the CPU engine; "
            "send a batch of input_ids (one per sample, each with its own sampling_seed) instead"
        )
    spec = SamplingSpec(
        max_new_tokens=_int(values.get("max_new_tokens", 128), "max_new_tokens"),
        temperature=_float(values.get("temperature", 1.0), "temperature"),
        top_p=_float(values.get("top_p", 1.0), "top_p"),
        top_k=_int(values.get("top_k", -1), "top_k"),
        stop=_stop_strings(values.get("stop", ())),
        stop_token_ids=frozenset(_int_list(values.get("stop_token_ids", []), "stop_token_ids")),
        ignore_eos=_bool(values.get("ignore_eos", False), "ignore_eos"),
        skip_special_tokens=_bool(values.get("skip_special_tokens", True), "skip_special_tokens"),
        no_stop_trim=_bool(values.get("no_stop_trim", False), "no_stop_trim"),
        sampling_seed=None
        if values.get("sampling_seed") is None
        else _int(values["sampling_seed"], "sampling_seed"),
    )
    if spec.sampling_seed is not None and not -(2**63) <= spec.sampling_seed < 2**64:
        raise BadRequest(f"sampling_seed must fit in 64 bits, got {spec.sampling_seed}")
    if spec.max_new_tokens < 0:
        raise BadRequest(f"max_new_tokens must be at least 0, got {spec.max_new_tokens} ({where})")
    if not math.isfinite(spec.temperature) or spec.temperature < 0:
        raise BadRequest(f"temperature must be a non-negative finite number, got {spec.temperature}")
    if not 0.0 < spec.top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {spec.top_p}")
    if spec.top_k != -1 and spec.top_k < 1:
        raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {spec.top_k}")
    return spec


def _prompts(body: dict, encode: Callable[[str], list[int]]) -> tuple[list[list[int]], bool]:
    ids, text = body.get("input_ids"), body.get("text")
    if (ids is None) == (text is None):
        raise BadRequest("exactly one of 'input_ids' or 'text' must be given")
    if text is not None:
        if isinstance(text, str):
            return [encode(text)], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [encode(t) for t in text], True
        raise BadRequest("'text' must be a string or a non-empty list of strings")
    if not isinstance(ids, list):
        raise BadRequest("'input_ids' must be a list of token ids or a list of such lists")
    if not ids:
        raise BadRequest("input_ids is empty")
    if all(isinstance(row, list) for row in ids):
        return ids, True
    return [ids], False


def _check_ids(ids: list, vocab_size: int, where: str) -> None:
    if not ids:
        raise BadRequest(f"{where} is empty")
    for position, token in enumerate(ids):
        if not isinstance(token, int) or isinstance(token, bool):
            raise BadRequest(f"{where}[{position}] = {token!r} is not an integer token id")
        if not 0 <= token < vocab_size:
            raise BadRequest(f"{where}[{position}] = {token} is outside the vocabulary [0, {vocab_size})")


def _check_length(prompt: int, new: int, limits: Limits, where: str) -> None:
    if prompt >= limits.context_length:
        raise BadRequest(
            f"the input ({prompt} tokens, {where}) is longer than the model's context length "
            f"({limits.context_length} tokens)"
        )
    if prompt + new > limits.context_length:
        raise BadRequest(
            f"requested token count exceeds the model's maximum context length of {limits.context_length} "
            f"tokens: {prompt} input tokens + max_new_tokens {new} ({where})"
        )
    if prompt + new > limits.max_total_tokens:
        raise BadRequest(
            f"{where}: {prompt} input tokens + max_new_tokens {new} exceed the engine's "
            f"max_total_tokens ({limits.max_total_tokens})"
        )


def _per_item(value: Any, count: int, name: str, kind: type) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise BadRequest(f"'{name}' has {len(value)} entries for a batch of {count}")
        for entry in value:
            _expect(entry, kind, name)
        return value
    _expect(value, kind, name)
    return [value] * count


def _expect(value: Any, kind: type, name: str) -> None:
    if value is None:
        return
    if kind is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise BadRequest(f"'{name}' must be an integer, got {value!r}")
    if kind is not int and not isinstance(value, kind):
        raise BadRequest(f"'{name}' must be a {kind.__name__}, got {value!r}")


def _rids(value: Any, count: int, is_batch: bool) -> list[str]:
    if value is None:
        return [uuid.uuid4().hex for _ in range(count)]
    if isinstance(value, str):
        # SGLang: in a batch, a single rid is a prefix for the per-item ids.
        return [f"{value}_{i}" for i in range(count)] if is_batch else [value]
    if isinstance(value, list) and len(value) == count and all(isinstance(r, str) for r in value):
        return value
    raise BadRequest("'rid' must be a string or a list of strings, one per input")


def _int(value: Any, name: str) -> int:
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not integral:
        raise BadRequest(f"{name} must be an integer, got {value!r}")
    return int(value)


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{name} must be a number, got {value!r}")
    return float(value)


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {value!r}")
    return value


def _int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise BadRequest(f"{name} must be a list of integers")
    return [_int(v, name) for v in value]


def _stop_strings(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) and s for s in value):
        raise BadRequest("stop must be a non-empty string or a list of non-empty strings")
    return tuple(value)
