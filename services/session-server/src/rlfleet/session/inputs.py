"""Request content turned into validated token IDs, budgets and sampling, with messages that say
what was wrong. Text is tokenized here, once; token IDs are checked against the vocabulary.

Size before work: the servicer calls the `*_off_loop` forms, which check sizes on the event loop
(text and messages against `max_text_chars`, token ids against the room left) and only then render
and tokenize, in a worker thread when the text is long (INLINE_CHARS), so one long request never
holds up the other sessions."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.session.v1 import session_pb2
from rlfleet.session.errors import InvalidSessionRequest, ObservationOverBudget, SessionNotOpen
from rlfleet.session.state import SessionState
from rlfleet.session.text import ChatRenderer, Tokenizer

# Below this many characters a text is rendered and tokenized on the event loop: tens of
# microseconds, less than the hand-off to a worker thread and back costs (the usual prompt and tool
# result); a longer one still goes to a thread.
INLINE_CHARS = 4096


@dataclass(frozen=True)
class Limits:
    context_length: int | None  # None: the model did not say
    default_budget: int
    max_text_chars: int
    max_metadata_bytes: int


class Inputs:
    def __init__(self, tokenizer: Tokenizer, renderer: ChatRenderer, limits: Limits) -> None:
        self.tokenizer = tokenizer
        self.renderer = renderer
        self.limits = limits

    def budget(self, requested: int) -> int:
        """A session's token budget: the request's, or the server default capped to the context."""
        context = self.limits.context_length
        if requested and context and requested > context:
            raise InvalidSessionRequest(
                f"max_total_tokens {requested} exceeds the model's context length ({context} tokens)",
                field="max_total_tokens")
        budget = requested or self.limits.default_budget
        return min(budget, context) if context else budget

    async def prompt_ids_off_loop(self, request: session_pb2.OpenSessionRequest, budget: int) -> list[int]:
        if self._check_sizes(request, "prompt", budget) <= INLINE_CHARS:
            return self.prompt_ids(request, budget)
        return await asyncio.to_thread(self.prompt_ids, request, budget)

    async def observation_ids_off_loop(self, request: session_pb2.AppendObservationRequest,
                                       state: SessionState) -> list[int]:
        if self._check_sizes(request, "content", state.remaining) <= INLINE_CHARS:
            return self.observation_ids(request, state)
        return await asyncio.to_thread(self.observation_ids, request, state)

    def _check_sizes(self, request, oneof: str, room: int) -> int:
        """Checks the sizes; the characters there are to render and tokenize (0 for token ids)."""
        kind = request.WhichOneof(oneof)
        if kind == "text":
            self._check_text_size(len(request.text), "text")
            return len(request.text)
        if kind == "messages":
            chars = sum(len(m.content) for m in request.messages.messages)
            self._check_text_size(chars, "messages")
            return chars
        if kind in ("prompt_token_ids", "token_ids"):
            count = len(getattr(request, kind).ids)
            if count > max(room, 0):
                raise InvalidSessionRequest(f"{kind} has {count} tokens, more than the {room} that fit",
                                            field=kind, limit=max(room, 0), size=count)
        return 0

    def prompt_ids(self, request: session_pb2.OpenSessionRequest, budget: int) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise InvalidSessionRequest("a prompt is required: prompt_token_ids or messages", field="prompt")
        if kind == "prompt_token_ids":
            ids = self.token_ids(list(request.prompt_token_ids.ids), "prompt_token_ids", budget)
        else:
            text = self._render(request.messages, add_generation_prompt=True, continuation=False)
            ids = self.tokenizer.encode(text)
        if not ids:
            raise InvalidSessionRequest(f"the prompt is empty ({kind})", field=kind)
        if len(ids) >= budget:
            raise InvalidSessionRequest(
                f"the prompt has {len(ids)} tokens, "
                f"which leaves no room in the session's budget of {budget} tokens", field=kind)
        return ids

    def observation_ids(self, request: session_pb2.AppendObservationRequest,
                        state: SessionState) -> list[int]:
        kind = request.WhichOneof("content")
        if kind is None:
            raise InvalidSessionRequest("an observation needs text, token_ids or messages", field="content",
                                        session_id=state.session_id)
        if kind == "text":
            self._check_text_size(len(request.text), "text")
            ids = self.tokenizer.encode(request.text)
        elif kind == "token_ids":
            ids = self.token_ids(list(request.token_ids.ids), "token_ids", state.remaining)
        else:
            ids = self.tokenizer.encode(self._framed(request, state))
        if not ids:
            raise InvalidSessionRequest(f"the observation is empty ({kind})", field=kind,
                                        session_id=state.session_id)
        if len(ids) > state.remaining:
            raise ObservationOverBudget(
                f"the observation has {len(ids)} tokens but only {state.remaining} of the session's "
                f"{state.session.max_total_tokens}-token budget remain; close the session as TRUNCATED",
                field=kind, session_id=state.session_id)
        return ids

    def token_ids(self, ids: list[int], field: str, room: int) -> list[int]:
        if len(ids) > max(room, 0):
            raise InvalidSessionRequest(f"{field} has {len(ids)} tokens, more than the {room} that fit",
                                        field=field, limit=max(room, 0), size=len(ids))
        bad = self.tokenizer.invalid_id(ids)
        if bad is not None:
            position, token = bad
            raise InvalidSessionRequest(
                f"{field}[{position}] = {token} is outside the vocabulary [0, {self.tokenizer.vocab_size})",
                field=field)
        return ids

    def metadata(self, metadata, field: str = "metadata") -> dict[str, str]:
        size = sum(len(k) + len(v) for k, v in metadata.items())
        if size > self.limits.max_metadata_bytes:
            raise InvalidSessionRequest(
                f"{field} has {size} characters, "
                f"more than max_metadata_bytes ({self.limits.max_metadata_bytes})", field=field)
        return dict(metadata)

    def turn_sampling(self, state: SessionState,
                      override: common_pb2.SamplingParams | None) -> common_pb2.SamplingParams:
        """The session's sampling defaults with this call's overrides, max_new_tokens capped to the budget."""
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(state.sampling)
        if sampling.HasField("seed"):
            # A session-wide seed gives each turn its own, reproducible, stream.
            sampling.seed = (sampling.seed + state.num_turns) % (1 << 64)
        if override is not None:
            _apply_override(sampling, override)
        wanted = sampling.max_new_tokens
        if wanted <= 0:
            raise InvalidSessionRequest(
                "sampling.max_new_tokens must be > 0 (in OpenSession's sampling or this call's), "
                f"got {wanted}", field="sampling.max_new_tokens", session_id=state.session_id)
        budget = state.session.max_total_tokens
        if wanted > budget:
            raise InvalidSessionRequest(
                f"sampling.max_new_tokens {wanted} exceeds the session's whole budget of {budget} tokens",
                field="sampling.max_new_tokens", session_id=state.session_id)
        if state.remaining <= 0:
            raise SessionNotOpen(f"session {state.session_id!r} has spent its budget "
                                 f"of {budget} tokens; close it",
                                 session_id=state.session_id, state="budget_exhausted")
        sampling.max_new_tokens = min(wanted, state.remaining)
        return sampling

    def check_sampling_defaults(self, sampling: common_pb2.SamplingParams, budget: int) -> None:
        if sampling.max_new_tokens < 0 or sampling.max_new_tokens > budget:
            raise InvalidSessionRequest(
                f"sampling.max_new_tokens must be in [1, {budget}] (0 = set it on each Generate), "
                f"got {sampling.max_new_tokens}", field="sampling.max_new_tokens")

    def _framed(self, request: session_pb2.AppendObservationRequest, state: SessionState) -> str:
        """Chat messages as the template renders them at this point of the conversation.

        After a generated turn: what the template puts after that turn's content (its closing, the
        messages, the next opening), less the stop token the turn already ended on. A turn cut
        short (max_new_tokens, a stop string) is thereby closed as the template closes it."""
        spans = state.session.spans
        if not spans or spans[-1].kind != common_pb2.SPAN_KIND_GENERATED:
            return self._render(request.messages, request.add_generation_prompt, continuation=True)
        plain = self._plain(request.messages)
        try:
            tail = self.renderer.render_after_turn(plain, request.add_generation_prompt)
        except ValueError as exc:
            raise InvalidSessionRequest(str(exc), field="messages") from None
        if tail is None:
            return self._render(request.messages, request.add_generation_prompt, continuation=True)
        span = spans[-1]
        if span.end > span.start:
            last = state.session.token_ids[span.end - 1]
            closing = self.tokenizer.special_tokens.get(last)
            if closing and tail.startswith(closing):
                tail = tail[len(closing):]
        return tail

    def _plain(self, messages: common_pb2.ChatMessages) -> list[dict[str, str]]:
        if not messages.messages:
            raise InvalidSessionRequest("messages is empty", field="messages")
        self._check_text_size(sum(len(m.content) for m in messages.messages), "messages")
        return [{"role": m.role, "content": m.content} for m in messages.messages]

    def _render(self, messages: common_pb2.ChatMessages, add_generation_prompt: bool,
                continuation: bool) -> str:
        plain = self._plain(messages)
        render = self.renderer.render_continuation if continuation else self.renderer.render
        try:
            return render(plain, add_generation_prompt)
        except ValueError as exc:
            raise InvalidSessionRequest(str(exc), field="messages") from None

    def _check_text_size(self, chars: int, field: str) -> None:
        if chars > self.limits.max_text_chars:
            raise InvalidSessionRequest(
                f"{field} has {chars} characters, more than max_text_chars ({self.limits.max_text_chars}); "
                "it was not tokenized", field=field, limit=self.limits.max_text_chars, size=chars)


def _apply_override(sampling: common_pb2.SamplingParams, override: common_pb2.SamplingParams) -> None:
    if override.max_new_tokens:
        sampling.max_new_tokens = override.max_new_tokens
    for name in ("temperature", "top_p", "top_k", "seed"):
        if override.HasField(name):
            setattr(sampling, name, getattr(override, name))
    if override.stop:
        sampling.ClearField("stop")
        sampling.stop.extend(override.stop)
    if override.stop_token_ids:
        sampling.ClearField("stop_token_ids")
        sampling.stop_token_ids.extend(override.stop_token_ids)
    if override.ignore_eos:
        sampling.ignore_eos = True
