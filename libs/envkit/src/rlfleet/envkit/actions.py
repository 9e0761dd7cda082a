"""What an assistant turn asks for: a tool call, a final answer, an invalid call, or nothing.

Rollout workers stop generation at a closing tag, so a turn holds at most one action; when a turn
holds more (an engine without stop strings), **only the first tag in the turn counts** and the rest
is ignored. The verifier re-derives the same decisions from the text (it does not trust the
worker), with the same rules; a contract test keeps the two in step.

Rules, applied to the first ``<name>`` or ``</name>`` tag in the turn:

- ``<answer>...</answer>`` -> :class:`FinalAnswer` (content stripped); the episode ends.
- ``<tool>...</tool>`` with a tool the task offers -> :class:`ToolCall`.
- a well-formed tag for a tool the task does not offer -> :class:`InvalidCall` (unknown tool).
- an opening tag without its closing tag, or a closing tag first -> :class:`InvalidCall` (malformed).
- no tag at all -> :class:`NoAction`; the episode ends without an answer.

An invalid call is answered with ``InvalidCall.error`` as the tool observation, so the policy sees
its mistake the same way it sees a calculator error.

A model family with its own tool-call format (``rlfleet.common.tool_calls``: Hermes, Llama 3 JSON,
Mistral) is parsed with that format instead: its first call counts (malformed -> invalid, a tool
the task does not offer -> unknown), ``<answer>...</answer>`` in a turn without a call is the final
answer, and a turn with neither is no action. The text parsed is the turn's tokens decoded with
special tokens kept; the tokens themselves are never changed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from rlfleet.common.chat import ANSWER_RE, TOOL_CALL_RE
from rlfleet.common.tool_calls import TagFormat, tool_call_format

ANSWER_TAG = "answer"
_ANY_TAG_RE = re.compile(r"<(/?)([a-z_]+)>")


@dataclass(frozen=True)
class ToolCall:
    tool: str
    args: str


@dataclass(frozen=True)
class FinalAnswer:
    answer: str


@dataclass(frozen=True)
class InvalidCall:
    error: str  # the observation the policy gets back, "error: ..."
    tool: str = ""


@dataclass(frozen=True)
class NoAction:
    pass


Action = ToolCall | FinalAnswer | InvalidCall | NoAction


def parse_action(text: str, tools: Iterable[str], fmt: str = TagFormat.name) -> Action:
    """The action of one assistant turn, by the rules in the module docstring; `fmt` names the
    model's tool-call format (`rlfleet.common.tool_calls.FORMATS`)."""
    if fmt != TagFormat.name:
        return _parse_formatted(text, sorted(tools), fmt)
    tag = _ANY_TAG_RE.search(text)
    if tag is None:
        return NoAction()
    closing, name = tag.group(1) == "/", tag.group(2)
    if closing:
        return InvalidCall(f"error: malformed tool call: </{name}> without <{name}>", tool=name)
    call = TOOL_CALL_RE.match(text, tag.start())
    if call is None:
        return InvalidCall(f"error: malformed tool call: <{name}> is not closed by </{name}>", tool=name)
    if name == ANSWER_TAG:
        return FinalAnswer(call["args"].strip())
    offered = sorted(tools)
    if name not in offered:
        return InvalidCall(f"error: unknown tool {name!r}; available: {', '.join(offered)}", tool=name)
    return ToolCall(name, call["args"])


def _parse_formatted(text: str, offered: list[str], fmt: str) -> Action:
    calls = tool_call_format(fmt).parse(text)
    if calls:
        call = calls[0]
        if not call.ok:
            return InvalidCall(f"error: {call.error}", tool=call.name)
        if call.name not in offered:
            return InvalidCall(f"error: unknown tool {call.name!r}; available: {', '.join(offered)}",
                               tool=call.name)
        return ToolCall(call.name, call.argument_text())
    answer = ANSWER_RE.search(text)
    return NoAction() if answer is None else FinalAnswer(answer["answer"].strip())


def too_many_calls_error(max_turns: int) -> str:
    """The observation for a tool call beyond the task's ``limits.max_turns``."""
    return f"error: tool call limit of {max_turns} reached; give your <answer>"
