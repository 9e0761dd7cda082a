"""Reads an episode's assistant turns: the committed answer and the invalid tool calls.

The rules are the environment SDK's (``rlfleet.envkit.actions``), re-derived here because the
verifier does not take a client's word for them:

- only the first tag of a turn counts (workers stop generating at a closing tag);
- the **first** ``<answer>`` of the episode is the answer; the episode ends there, and any later
  answer, in the same turn or after it, is ignored, so listing several answers cannot hedge;
- a tool call is invalid when its tool is not offered by the task, when its tag is malformed
  (opened and not closed, or closed first), when it is call number ``max_turns + 1`` or later, or
  when the sandbox reported an error for it (e.g. an unparseable calc expression).
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field

from rlfleet.common.chat import TOOL_CALL_RE
from rlfleet.verifier.kinds.records import Episode, Reason, ReasonCode

_ANY_TAG_RE = re.compile(r"<(/?)([a-z_]+)>")
_SNIPPET = 120


@dataclass
class TurnReading:
    answer: str | None = None
    invalid: list[Reason] = field(default_factory=list)


def read_turns(episode: Episode, tools: list[str], max_turns: int) -> TurnReading:
    if not episode.assistant_texts:
        # A bare answer (offline scoring): only the sandbox's records can show invalid calls.
        invalid = [
            _invalid(f"the {r.tool} tool reported an error", -1, r.tool, r.observation)
            for r in episode.tool_calls
            if not r.ok
        ]
        return TurnReading(episode.answer.strip() if episode.answer is not None else None, invalid)
    reading = TurnReading()
    records = iter(episode.tool_calls)
    calls = 0
    for turn, text in enumerate(episode.assistant_texts):
        tag = _ANY_TAG_RE.search(text)
        if tag is None:
            continue
        name = tag.group(2)
        call = None if tag.group(1) else TOOL_CALL_RE.match(text, tag.start())
        if call is None:
            reading.invalid.append(
                _invalid(f"malformed tool call: {tag.group(0)} is not a closed pair", turn, name, text)
            )
        elif name == "answer":
            reading.answer = call["args"].strip()
            break
        elif name not in tools:
            reading.invalid.append(_invalid(f"unknown tool {name!r}", turn, name, call["args"]))
        else:
            calls += 1
            if calls > max_turns:
                reading.invalid.append(
                    _invalid(f"tool call {calls} exceeds max_turns={max_turns}", turn, name, call["args"])
                )
                continue
            record = next(records, None)
            if record is not None and not record.ok:
                reading.invalid.append(
                    _invalid(f"the {name} tool reported an error", turn, name, record.observation)
                )
    return reading


def offered_call(text: str, tools: Collection[str]) -> tuple[str, str] | None:
    """``(tool, args)`` when the turn's first tag is a well-formed call of an offered tool: the turns
    whose calls a worker runs (those within ``max_turns``) and that get an observation back."""
    tag = _ANY_TAG_RE.search(text)
    if tag is None or tag.group(1) or tag.group(2) == "answer" or tag.group(2) not in tools:
        return None
    call = TOOL_CALL_RE.match(text, tag.start())
    return None if call is None else (call["tool"], call["args"])


def _invalid(message: str, turn: int, tool: str, text: str) -> Reason:
    details = {"turn": str(turn), "tool": tool, "text": text[:_SNIPPET]}
    return Reason(ReasonCode.INVALID_TOOL_CALL, message, details)
