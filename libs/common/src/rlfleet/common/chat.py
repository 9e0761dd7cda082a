"""The chat format every built-in component agrees on.

The default tokenizer is trained here with these special tokens and ships this template in its
``tokenizer_config.json``; the session server renders prompts with it once, and the built-in task
suites parse the model's replies with the patterns below. A real model brings its own template,
which the session server then uses instead.
"""

from __future__ import annotations

import re

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)

# Qwen-style ChatML. `add_generation_prompt` opens the assistant turn the engine completes.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

ROLES = ("system", "user", "assistant", "tool")

# Tool calls and final answers inside an assistant turn: `<calc>12*(3+4)</calc>`, `<answer>84</answer>`.
TOOL_CALL_RE = re.compile(r"<(?P<tool>[a-z_]+)>(?P<args>.*?)</(?P=tool)>", re.DOTALL)
ANSWER_RE = re.compile(r"<answer>(?P<answer>.*?)</answer>", re.DOTALL)


def render_messages(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    """Renders messages with the default template without needing jinja at import time."""
    parts = []
    for message in messages:
        role = message["role"]
        if role not in ROLES:
            raise ValueError(f"unknown chat role {role!r}; expected one of {', '.join(ROLES)}")
        parts.append(f"{IM_START}{role}\n{message['content']}{IM_END}\n")
    if add_generation_prompt:
        parts.append(f"{IM_START}assistant\n")
    return "".join(parts)


def tool_calls(text: str) -> list[tuple[str, str]]:
    """The (tool, arguments) pairs in an assistant turn, `answer` excluded."""
    return [(m["tool"], m["args"]) for m in TOOL_CALL_RE.finditer(text) if m["tool"] != "answer"]


def final_answer(text: str) -> str | None:
    match = ANSWER_RE.search(text)
    return None if match is None else match["answer"].strip()
