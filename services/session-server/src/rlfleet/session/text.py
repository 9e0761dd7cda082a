"""Text at the edges of a session: the tokenizer (HF `tokenizers`) and the chat template.

Text becomes tokens exactly once, when a prompt or an observation is appended; generated tokens are
decoded only so the client can parse them. Special tokens written in the text (`<|im_start|>`) map to
their IDs, and no BOS/EOS is added (`add_special_tokens=False`): the template says where they go.

The chat template is the model's own (`chat_template` in tokenizer_config.json, or a
chat_template.jinja file), rendered in jinja2's immutable sandbox like transformers does, or
rlfleet's built-in ChatML when the model has none.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from rlfleet.common.chat import ROLES, render_messages
from rlfleet.common.errors import StartupError

Messages = list[dict[str, str]]


class Tokenizer:
    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as HfTokenizer

        file = Path(path) / "tokenizer.json"
        if not file.exists():
            raise StartupError(f"tokenizer_path {path!r} has no tokenizer.json")
        self.path = Path(path)
        self.json = file.read_text(encoding="utf-8")
        self._tokenizer = HfTokenizer.from_str(self.json)
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.special_tokens = {index: token.content for index, token in
                               self._tokenizer.get_added_tokens_decoder().items() if token.special}
        self.stop_token_ids = sorted(_eos_ids(self.path))

    def encode(self, text: str) -> list[int]:
        # encode_batch, not encode: it releases the GIL while it works, so tokenizing in a worker
        # thread (Inputs.*_off_loop) leaves the event loop to other sessions; encode holds it throughout.
        return self._tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def invalid_id(self, ids: list[int]) -> tuple[int, int] | None:
        """(position, id) of the first id outside the vocabulary, or None."""
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            return next((i, t) for i, t in enumerate(ids) if not 0 <= t < self.vocab_size)
        return None


def _eos_ids(path: Path) -> set[int]:
    """EOS ids from generation_config.json and config.json (an int or a list in either), as the engine
    reads them."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        file = path / name
        value = json.loads(file.read_text()).get("eos_token_id") if file.exists() else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return ids


# Stands in for an assistant turn's content, to find what the template renders after it.
_TURN = "\u2063rlfleet-turn\u2063"


class ChatRenderer:
    """Renders chat messages with the model's template (or the built-in one)."""

    # Rendering an observation alone would let a template add what only a conversation's start
    # has (e.g. a default system prompt), so the messages are rendered after this stand-in
    # conversation and only the text after it is kept.
    _CONTEXT: Messages = [{"role": "system", "content": ""}, {"role": "user", "content": ""},
                          {"role": "assistant", "content": ""}]

    def __init__(self, template: str | None, special_tokens: dict[str, str]) -> None:
        self.template_source = template
        self.special_tokens = special_tokens
        self._template = _compile(template) if template else None

    @property
    def uses_model_template(self) -> bool:
        return self._template is not None

    def render(self, messages: Messages, add_generation_prompt: bool, tools: list | None = None) -> str:
        _check_roles(messages)
        if self._template is None:
            return render_messages(messages, add_generation_prompt)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, **self.special_tokens)
        except TemplateError as exc:
            raise ValueError(f"the chat template refused the messages: {exc}") from None

    def render_after_turn(self, messages: Messages, add_generation_prompt: bool) -> str | None:
        """The text the template renders after an assistant turn's content up to the end of
        `messages` (the turn's closing, the messages, the next opening); None when no stand-in
        conversation renders (a template with stricter rules)."""
        for context in ([{"role": "user", "content": "x"}],
                         [{"role": "system", "content": "x"}, {"role": "user", "content": "x"}]):
            try:
                text = self.render([*context, {"role": "assistant", "content": _TURN}, *messages],
                                   add_generation_prompt)
            except ValueError:
                continue
            at = text.find(_TURN)
            if at >= 0:
                return text[at + len(_TURN):]
        return None

    def render_continuation(self, messages: Messages, add_generation_prompt: bool) -> str:
        """The text `messages` add to a conversation already under way (an observation)."""
        if self._template is None:
            return self.render(messages, add_generation_prompt)
        try:
            before = self.render(self._CONTEXT, add_generation_prompt=False)
            after = self.render([*self._CONTEXT, *messages], add_generation_prompt)
        except ValueError:  # a template that refuses the stand-in (e.g. strict role order): render alone
            return self.render(messages, add_generation_prompt)
        if not after.startswith(before):
            return self.render(messages, add_generation_prompt)
        return after[len(before):]


def load_chat_renderer(path: str, mode: str) -> ChatRenderer:
    config = _tokenizer_config(path)
    template = None
    if mode == "auto":
        jinja_file = Path(path) / "chat_template.jinja"
        template = jinja_file.read_text() if jinja_file.exists() else _template_from_config(config)
    special = {name: _token_text(config.get(name))
               for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    return ChatRenderer(template, special)


def model_context_length(path: str) -> int | None:
    """The model's context length from config.json (max_position_embeddings) or tokenizer_config.json."""
    model_config = Path(path) / "config.json"
    if model_config.exists():
        value = json.loads(model_config.read_text()).get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    value = _tokenizer_config(path).get("model_max_length")
    # transformers writes a huge sentinel when the length is unknown.
    if isinstance(value, int) and 0 < value < 1 << 24:
        return value
    return None


def _tokenizer_config(path: str) -> dict[str, Any]:
    file = Path(path) / "tokenizer_config.json"
    return json.loads(file.read_text()) if file.exists() else {}


def _template_from_config(config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _token_text(token: Any) -> str:
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token or ""


def _check_roles(messages: Messages) -> None:
    for message in messages:
        if message["role"] not in ROLES:
            raise ValueError(f"unknown chat role {message['role']!r}; expected one of {', '.join(ROLES)}")


def _compile(template: str):
    """The template in jinja2's immutable sandbox, with the globals transformers gives templates."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)
