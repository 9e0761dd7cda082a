"""Tool-call formats: how each model family writes a call in an assistant turn, parsed from (and
rendered into) the turn's text.

The text parsed is the generated tokens decoded with their special tokens kept (a session's
`GenerateResponse.text_with_special_tokens`): `[TOOL_CALLS]` and, in some tokenizers, `<tool_call>`
are special tokens that a plain decode drops. Parsing only reads: the turn's token IDs are what
the trainer sees, whatever a parser makes of them, and nothing here is ever tokenized back into a
session. `render` writes a call the way the family's chat template renders one (demonstrations for
a warm start, test fixtures).

    tags         rlfleet's built-in `<calc>12*(3+4)</calc>` (the default qwen2 model)
    hermes       Qwen2.5/Qwen3: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
    llama3_json  Llama 3.1: the turn is one `{"name": ..., "parameters": {...}}` object
    mistral      Mistral v0.3: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`

A family's format is `rlfleet.common.families.Family.tool_call_format`; the rollout worker takes
it from config (`tool_call_format`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ParsedCall:
    name: str  # "" when the call is too malformed to name its tool
    arguments: dict[str, Any] = field(default_factory=dict)
    raw: str = ""  # the call's text, as generated
    error: str = ""  # set when the call is malformed (the observation says why)

    @property
    def ok(self) -> bool:
        return not self.error

    def argument_text(self) -> str:
        """The arguments as one string for tools that take one (calc's expression), else as JSON."""
        if len(self.arguments) == 1:
            (value,) = self.arguments.values()
            if isinstance(value, str):
                return value
        return json.dumps(self.arguments, ensure_ascii=False)


class ToolCallFormat(Protocol):
    name: str

    def parse(self, text: str) -> list[ParsedCall]:
        """The calls in one assistant turn, in order; malformed ones carry `error`."""

    def render(self, name: str, arguments: dict[str, Any]) -> str:
        """One call as the family's template renders it in an assistant turn."""


_DECODER = json.JSONDecoder()


def _json_call(text: str, arguments_key: tuple[str, ...]) -> ParsedCall:
    """One `{"name": ..., "<arguments>": {...}}` object (the whole of `text`, whitespace aside)."""
    raw = text.strip()
    try:
        value, end = _DECODER.raw_decode(raw)
    except json.JSONDecodeError as exc:
        return ParsedCall("", raw=raw, error=f"malformed tool call: not JSON ({exc.msg} at {exc.pos})")
    return _call_object(value, raw, arguments_key, trailing=raw[end:].strip())


def _call_object(value: Any, raw: str, arguments_key: tuple[str, ...], trailing: str = "") -> ParsedCall:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return ParsedCall("", raw=raw,
                          error='malformed tool call: expected {"name": ..., "arguments": {...}}')
    name = value["name"]
    if trailing:
        return ParsedCall(name, raw=raw, error="malformed tool call: text after the call's JSON")
    arguments: Any = next((value[k] for k in arguments_key if k in value), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ParsedCall(name, raw=raw, error="malformed tool call: arguments are not JSON")
    if not isinstance(arguments, dict):
        return ParsedCall(name, raw=raw, error="malformed tool call: arguments must be a JSON object")
    return ParsedCall(name, arguments, raw=raw)


class TagFormat:
    """`<tool>args</tool>`; `<answer>` is the final answer, not a call."""

    name = "tags"
    _TAG = re.compile(r"<(?P<tool>[a-z_]+)>(?P<args>.*?)</(?P=tool)>", re.DOTALL)

    def parse(self, text: str) -> list[ParsedCall]:
        return [ParsedCall(m["tool"], {"input": m["args"]}, raw=m.group(0)) for m in self._TAG.finditer(text)
                if m["tool"] != "answer"]

    def render(self, name: str, arguments: dict[str, Any]) -> str:
        return f"<{name}>{ParsedCall(name, arguments).argument_text()}</{name}>"


class HermesFormat:
    name = "hermes"
    _CALL = re.compile(r"<tool_call>(?P<body>.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> list[ParsedCall]:
        calls = []
        for match in self._CALL.finditer(text):
            if not match.group(0).endswith("</tool_call>"):
                calls.append(ParsedCall("", raw=match.group(0),
                                        error="malformed tool call: <tool_call> is not closed by "
                                              "</tool_call>"))
                continue
            calls.append(_json_call(match["body"], ("arguments", "parameters")))
        return calls

    def render(self, name: str, arguments: dict[str, Any]) -> str:
        return (f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {json.dumps(arguments)}}}'
                '\n</tool_call>')


class Llama3JsonFormat:
    """A call is the whole turn: one JSON object (optionally after `<|python_tag|>`)."""

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str) -> list[ParsedCall]:
        body = text.strip()
        for end in ("<|eot_id|>", "<|eom_id|>"):
            body = body.removesuffix(end).rstrip()
        body = body.removeprefix(self.PYTHON_TAG).lstrip()
        if not body.startswith("{"):
            return []
        return [_json_call(body, ("parameters", "arguments"))]

    def render(self, name: str, arguments: dict[str, Any]) -> str:
        return f'{{"name": {json.dumps(name)}, "parameters": {json.dumps(arguments)}}}'


class MistralFormat:
    name = "mistral"
    MARKER = "[TOOL_CALLS]"

    def parse(self, text: str) -> list[ParsedCall]:
        at = text.find(self.MARKER)
        if at < 0:
            return []
        body = text[at + len(self.MARKER):].strip().removesuffix("</s>").rstrip()
        try:
            value, end = _DECODER.raw_decode(body)
        except json.JSONDecodeError as exc:
            return [ParsedCall("", raw=body, error=f"malformed tool call: not JSON ({exc.msg} at {exc.pos})")]
        if isinstance(value, dict):
            value = [value]
        if not isinstance(value, list) or not value:
            return [ParsedCall("", raw=body, error="malformed tool call: expected a JSON list of calls")]
        trailing = body[end:].strip()
        return [_call_object(item, json.dumps(item), ("arguments", "parameters"),
                             trailing=trailing if i == len(value) - 1 else "")
                for i, item in enumerate(value)]

    def render(self, name: str, arguments: dict[str, Any]) -> str:
        return f'[TOOL_CALLS] [{{"name": {json.dumps(name)}, "arguments": {json.dumps(arguments)}}}]'


FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (TagFormat(), HermesFormat(), Llama3JsonFormat(),
                                                         MistralFormat())}


def tool_call_format(name: str) -> ToolCallFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call format {name!r}; expected one of {', '.join(FORMATS)}") from None
