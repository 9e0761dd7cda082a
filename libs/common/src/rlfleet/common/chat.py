"""The chat format every built-in component agrees on.

The default tokenizer is trained here with these special tokens and ships this template in its
``tokenizer_config.json``; the session server renders prompts with it once, and the built-in task
suites parse the model's replies with the patterns below. A real model brings its own template,
which the session server then uses instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

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


# -- the default tokenizer ----------------------------------------------------------------------


# Qwen2's pre-tokenizer split: transformers loads a `model_type: qwen2` directory with
# Qwen2Tokenizer, which installs this split whatever tokenizer.json says, so training with the
# same split is what makes AutoTokenizer and plain `tokenizers` produce the same ids. It also
# puts every digit in its own pre-token, so arithmetic in tool calls tokenizes uniformly.
QWEN2_SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
                     r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def train_tokenizer(texts: Iterable[str], vocab_size: int, special_tokens: Sequence[str] = SPECIAL_TOKENS,
                    split_regex: str = QWEN2_SPLIT_REGEX):
    """A byte-level BPE tokenizer with `special_tokens` at ids 0, 1, 2, ... (the default chat
    format's three unless a model family names its own, `rlfleet.common.families`).

    Every byte is in the base alphabet, so any text encodes without unknown tokens. The vocabulary
    can come out smaller than `vocab_size` when the corpus has too few repeated pairs.
    """
    try:
        # Optional: the light services import this module and never train a tokenizer.
        from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    except ImportError as exc:
        raise RuntimeError("training the default tokenizer needs the `tokenizers` package "
                           "(rlfleet-common[tokenizer])") from exc

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split_regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(texts), trainer=trainer)
    for index, token in enumerate(special_tokens):
        # The engine, the session server and the trainer rely on these ids.
        assert tokenizer.token_to_id(token) == index, (token, tokenizer.token_to_id(token))
    return tokenizer


def tokenizer_config(model_max_length: int) -> dict:
    """`tokenizer_config.json`: what AutoTokenizer needs beyond tokenizer.json."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "bos_token": None,
        "eos_token": END_OF_TEXT,
        "pad_token": END_OF_TEXT,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
