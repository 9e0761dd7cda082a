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
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from rlfleet.common.chat import TOOL_CALL_RE

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


def parse_action(text: str, tools: Iterable[str]) -> Action:
    """The action of one assistant turn, by the rules in the module docstring."""
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


def too_many_calls_error(max_turns: int) -> str:
    """The observation for a tool call beyond the task's ``limits.max_turns``."""
    return f"error: tool call limit of {max_turns} reached; give your <answer>"
