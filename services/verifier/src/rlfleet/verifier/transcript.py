"""From what was generated to an `Episode`: the assistant turns, and each executed call with its observation.

Two sources, one shape (a list of `Turn`):

- a session's tokens (`turns_from_session`): GENERATED spans are the assistant's turns (consecutive
  ones are one turn), decoded with the policy's tokenizer; OBSERVATION spans are decoded and read as
  chat messages (`<|im_start|>tool\\n...<|im_end|>`), or taken whole when they carry no chat markup.
- a transcript text (`turns_from_text`, audits): a ChatML-rendered conversation, or one assistant turn.

The verifier never takes a client's parse: answers and invalid calls are derived by the kinds' own
rules (`rlfleet.verifier.kinds.turns`) from these texts. A tool call counts as failed (``ok=False``)
when its observation is an error line (``error: ...``), as the built-in tools and workers report them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlfleet.api.common.v1 import common_pb2
from rlfleet.api.session.v1 import session_pb2
from rlfleet.common.chat import IM_END, IM_START, SPECIAL_TOKENS
from rlfleet.common.errors import FailedPrecondition
from rlfleet.verifier.kinds import Episode, ToolCallRecord
from rlfleet.verifier.kinds.base import tool_names
from rlfleet.verifier.kinds.turns import offered_call

if TYPE_CHECKING:  # imported at first use (below): only verifying a session needs it
    from tokenizers import Tokenizer

_MESSAGE_RE = re.compile(
    re.escape(IM_START) + r"(?P<role>[a-z]+)\n(?P<content>.*?)(?=" + re.escape(IM_END) + "|"
    + re.escape(IM_START) + r"|\Z)",
    re.DOTALL)
_SPECIAL_RE = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))


@dataclass(frozen=True)
class Turn:
    role: str  # assistant | tool | user
    text: str


class SessionDecoder:
    """Decodes session token IDs with the policy's tokenizer (`tokenizer.json`, HF `tokenizers`)."""

    def __init__(self, tokenizer_path: str) -> None:
        self.path = tokenizer_path
        self._tokenizer: Tokenizer | None = None

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            if not self.path:
                raise FailedPrecondition("verifying a session needs the policy's tokenizer: "
                                         "set tokenizer_path")
            from tokenizers import Tokenizer

            file = Path(self.path)
            file = file / "tokenizer.json" if file.is_dir() else file
            if not file.is_file():
                raise FailedPrecondition(f"tokenizer_path {self.path} has no tokenizer.json")
            self._tokenizer = Tokenizer.from_file(str(file))
        return self._tokenizer

    def decode(self, ids: Sequence[int], *, keep_special: bool) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=not keep_special)


def turns_from_session(session: session_pb2.Session, decoder: SessionDecoder) -> list[Turn]:
    turns: list[Turn] = []
    previous = common_pb2.SPAN_KIND_UNSPECIFIED
    for span in session.spans:
        ids = session.token_ids[span.start:span.end]
        if span.kind == common_pb2.SPAN_KIND_GENERATED:
            text = decoder.decode(ids, keep_special=False)
            if previous == common_pb2.SPAN_KIND_GENERATED:
                turns[-1] = Turn("assistant", turns[-1].text + text)
            else:
                turns.append(Turn("assistant", text))
        elif span.kind == common_pb2.SPAN_KIND_OBSERVATION:
            turns.extend(observation_turns(decoder.decode(ids, keep_special=True)))
        previous = span.kind
    return turns


def session_truncated(session: session_pb2.Session) -> bool:
    """The episode hit a budget: its last turn stopped at the length limit, or the token budget is spent."""
    generated = [s for s in session.spans if s.kind == common_pb2.SPAN_KIND_GENERATED]
    if generated and generated[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH:
        return True
    return bool(session.max_total_tokens) and len(session.token_ids) >= session.max_total_tokens


# Tool results as the other model families' templates frame them (rlfleet.common.families): Hermes
# (Qwen2.5/Qwen3) inside a user turn, Llama 3 in the `ipython` role, Mistral in [TOOL_RESULTS].
_HERMES_RESULT_RE = re.compile(r"<tool_response>\n?(?P<content>.*?)\n?</tool_response>", re.DOTALL)
_LLAMA_MESSAGE_RE = re.compile(
    r"<\|start_header_id\|>(?P<role>[a-z]+)<\|end_header_id\|>\n\n(?P<content>.*?)(?=<\|eot_id\|>|<\|eom_id\|>|"
    r"<\|start_header_id\|>|\Z)", re.DOTALL)
_MISTRAL_RESULT_RE = re.compile(r"\[TOOL_RESULTS\]\s*(?P<content>.*?)\s*\[/TOOL_RESULTS\]", re.DOTALL)
_MISTRAL_USER_RE = re.compile(r"\[INST\]\s?(?P<content>.*?)\[/INST\]", re.DOTALL)


def observation_turns(text: str) -> list[Turn]:
    """Tool (and user) messages of an observation span, in the chat format it is framed in (ChatML,
    Hermes, Llama 3, Mistral); the whole text as one tool message without markup."""
    if "<tool_response>" in text:
        return [Turn("tool", m["content"].strip()) for m in _HERMES_RESULT_RE.finditer(text)]
    if "<|start_header_id|>" in text:
        roles = {"ipython": "tool", "tool": "tool", "user": "user"}
        return [Turn(roles[m["role"]], m["content"].strip()) for m in _LLAMA_MESSAGE_RE.finditer(text)
                if m["role"] in roles]
    if "[TOOL_RESULTS]" in text or "[INST]" in text:
        turns = []
        for m in sorted([*_MISTRAL_RESULT_RE.finditer(text), *_MISTRAL_USER_RE.finditer(text)],
                        key=lambda m: m.start()):
            if m.re is _MISTRAL_USER_RE:
                turns.append(Turn("user", m["content"].strip()))
                continue
            try:
                content = json.loads(m["content"])
            except json.JSONDecodeError:
                content = m["content"]
            turns.append(Turn("tool",
                              str(content.get("content", "")) if isinstance(content, dict) else str(content)))
        return turns
    if IM_START not in text:
        return [Turn("tool", _SPECIAL_RE.sub("", text).strip())]
    return [Turn(m["role"], m["content"].strip()) for m in _MESSAGE_RE.finditer(text)
            if m["role"] in ("tool", "user")]


def turns_from_text(transcript: str) -> list[Turn]:
    """A ChatML-rendered conversation as turns; plain text is one assistant turn."""
    if IM_START not in transcript:
        return [Turn("assistant", transcript)] if transcript else []
    return [Turn(m["role"], m["content"].strip() if m["role"] != "assistant" else m["content"])
            for m in _MESSAGE_RE.finditer(transcript) if m["role"] in ("assistant", "tool", "user")]


def episode_from_turns(turns: Sequence[Turn], task: Mapping[str, Any], *, truncated: bool = False) -> Episode:
    """Assistant texts in order, and one record per offered, well-formed call with the
    observation after it."""
    tools = tool_names(task)
    texts: list[str] = []
    records: list[ToolCallRecord] = []
    call: tuple[str, str] | None = None
    observed: list[str] = []

    def close_call() -> None:
        if call is not None:
            observation = "\n".join(observed)
            records.append(ToolCallRecord(call[0], call[1], observation,
                                          ok=not observation.startswith("error:")))

    for turn in turns:
        if turn.role == "assistant":
            close_call()
            texts.append(turn.text)
            call, observed = offered_call(turn.text, tools), []
        elif turn.role == "tool" and call is not None:
            observed.append(turn.text)
    close_call()
    return Episode(assistant_texts=texts, tool_calls=records, truncated=truncated)
