"""Model families rlfleet builds tiny members of, for tests and small runs: each family's special
tokens, chat template (its real format, tool calls included) and tool-call format.

A model directory from the Hub brings all of this itself (tokenizer.json, tokenizer_config.json's
`chat_template` and special tokens, generation_config.json's EOS ids), and every component reads
it from the directory. These definitions exist only so that `rlfleet-build-model --family NAME`
can write a directory that looks like one of that family's checkpoints: trained-here byte-level
BPE with the family's special tokens, a transformers config of the family's architecture, and a
template that renders what that family's own template renders.

Templates are written the way the Hub's are (`{%-`/`{{-` strip the layout whitespace) and are
rendered by transformers' `apply_chat_template` and by the session server's sandboxed jinja alike.
Tool calls in assistant messages are HF's shape: `{"type": "function", "function": {"name": ...,
"arguments": {...}}}` (`arguments` a mapping or a JSON string).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfleet.common.chat import CHAT_TEMPLATE, END_OF_TEXT, IM_END, IM_START, QWEN2_SPLIT_REGEX

# Llama 3's pre-tokenizer split: as Qwen2's, but digits group in threes.
LLAMA3_SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
                      r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


@dataclass(frozen=True)
class Family:
    name: str
    model_type: str  # transformers' config model_type
    special_tokens: tuple[str, ...]  # ids 0..n-1 of a tokenizer trained here
    bos_token: str | None
    eos_token: str
    pad_token: str
    unk_token: str | None
    stop_tokens: tuple[str, ...]  # generation_config.json's eos_token_id, in this order
    chat_template: str
    tool_call_format: str  # a name in rlfleet.common.tool_calls.FORMATS
    split_regex: str
    tie_word_embeddings: bool

    def tokenizer_config(self, model_max_length: int) -> dict:
        """`tokenizer_config.json`: what AutoTokenizer needs beyond tokenizer.json."""
        named = {self.bos_token, self.eos_token, self.pad_token, self.unk_token}
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": model_max_length,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
            "additional_special_tokens": [t for t in self.special_tokens if t not in named],
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "padding_side": "left",
            "chat_template": self.chat_template,
        }


# Qwen2.5 / Qwen3 (non-thinking) ChatML with Hermes-style tool calls: the tool list in the system
# turn, each call a JSON object inside <tool_call></tool_call>, consecutive tool results grouped
# in one user turn inside <tool_response></tool_response>.
HERMES_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.content %}{{- message.content }}{%- endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{%- if (loop.first and message.content) or not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""  # noqa: E501 (the template's text)

# Llama 3.1 with JSON tool calls: headers around each role, <|eot_id|> ending each turn, the tool
# list in the system turn (the template's tools_in_user_message=false path), a call as one
# `{"name": ..., "parameters": ...}` object, results in the `ipython` role.
LLAMA3_TEMPLATE = """\
{{- bos_token }}
{%- if messages[0].role == 'system' %}
{%- set system_message = messages[0].content | trim %}
{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set system_message = '' %}
{%- set loop_messages = messages %}
{%- endif %}
{%- if system_message or tools %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools %}
{{- 'Environment: ipython\\n\\n' }}
{{- 'You have access to the following functions. To call a function, respond with JSON for a '
    'function call in the format {"name": function name, "parameters": dictionary of argument '
    'name and its value}. Do not use variables.\\n\\n' }}
{%- for tool in tools %}{{- tool | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}
{%- endif %}
{{- system_message + '<|eot_id|>' }}
{%- endif %}
{%- for message in loop_messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{%- if message.tool_calls | length != 1 %}
{{- raise_exception('This model only supports single tool-calls at once!') }}
{%- endif %}
{%- set tool_call = message.tool_calls[0] %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{{- '{"name": "' + tool_call.name + '", "parameters": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}<|eot_id|>' }}
{%- elif message.role == 'assistant' %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- elif message.role == 'tool' or message.role == 'ipython' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}
{%- if message.content is mapping or message.content is iterable and message.content is not string %}
{{- message.content | tojson }}
{%- else %}
{{- message.content }}
{%- endif %}
{{- '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""  # noqa: E501 (the template's text)

# Mistral-7B-Instruct-v0.3 with tool calls: [INST] ... [/INST] user turns (the system prompt
# joins the last user turn), the tool list before the last user turn in [AVAILABLE_TOOLS], a
# reply closed by </s>, calls as `[TOOL_CALLS] [{"name": ..., "arguments": ...}]</s>`, results in
# [TOOL_RESULTS] ... [/TOOL_RESULTS]. The generation prompt is the [/INST] itself. Assistant
# content is rendered as it is, not trimmed, so that generated text renders back to its tokens.
MISTRAL_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
{%- set system_message = messages[0].content %}
{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set loop_messages = messages %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr('role', 'equalto', 'user') | list %}
{{- bos_token }}
{%- for message in loop_messages %}
{%- if message.role == 'user' %}
{%- if tools and user_messages and message == user_messages[-1] %}
{{- '[AVAILABLE_TOOLS] ' + tools | tojson + '[/AVAILABLE_TOOLS]' }}
{%- endif %}
{%- if system_message is defined and user_messages and message == user_messages[-1] %}
{{- '[INST] ' + system_message + '\\n\\n' + message.content + '[/INST]' }}
{%- else %}
{{- '[INST] ' + message.content + '[/INST]' }}
{%- endif %}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '[TOOL_CALLS] [' }}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set call = tool_call.function %}{%- else %}{%- set call = tool_call %}{%- endif %}
{{- '{"name": "' + call.name + '", "arguments": ' }}
{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}
{%- if tool_call.id is defined %}{{- ', "id": "' + tool_call.id + '"' }}{%- endif %}
{{- '}' }}
{%- if not loop.last %}{{- ', ' }}{%- endif %}
{%- endfor %}
{{- ']' + eos_token }}
{%- elif message.role == 'assistant' %}
{{- message.content + eos_token }}
{%- elif message.role == 'tool' %}
{{- '[TOOL_RESULTS] {"content": ' + message.content | tojson }}
{%- if message.tool_call_id is defined %}{{- ', "call_id": "' + message.tool_call_id + '"' }}{%- endif %}
{{- '}[/TOOL_RESULTS]' }}
{%- else %}
{{- raise_exception('Only user, assistant and tool roles are supported after the system message!') }}
{%- endif %}
{%- endfor %}
"""  # noqa: E501 (the template's text)

QWEN2 = Family(
    name="qwen2", model_type="qwen2", special_tokens=(END_OF_TEXT, IM_START, IM_END), bos_token=None,
    eos_token=END_OF_TEXT, pad_token=END_OF_TEXT, unk_token=None, stop_tokens=(END_OF_TEXT, IM_END),
    chat_template=CHAT_TEMPLATE, tool_call_format="tags", split_regex=QWEN2_SPLIT_REGEX,
    tie_word_embeddings=True)

QWEN3 = Family(
    name="qwen3", model_type="qwen3",
    special_tokens=(END_OF_TEXT, IM_START, IM_END, "<tool_call>", "</tool_call>", "<tool_response>",
                    "</tool_response>", "<think>", "</think>"),
    bos_token=None, eos_token=IM_END, pad_token=END_OF_TEXT, unk_token=None,
    stop_tokens=(IM_END, END_OF_TEXT),
    chat_template=HERMES_TEMPLATE, tool_call_format="hermes", split_regex=QWEN2_SPLIT_REGEX,
    tie_word_embeddings=True)

LLAMA = Family(
    name="llama", model_type="llama",
    special_tokens=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                    "<|eot_id|>", "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>"),
    bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="<|finetune_right_pad_id|>",
    unk_token=None, stop_tokens=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
    chat_template=LLAMA3_TEMPLATE, tool_call_format="llama3_json", split_regex=LLAMA3_SPLIT_REGEX,
    tie_word_embeddings=True)

MISTRAL = Family(
    name="mistral", model_type="mistral",
    special_tokens=("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                    "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
    bos_token="<s>", eos_token="</s>", pad_token="</s>", unk_token="<unk>", stop_tokens=("</s>",),
    chat_template=MISTRAL_TEMPLATE, tool_call_format="mistral", split_regex=QWEN2_SPLIT_REGEX,
    tie_word_embeddings=False)

FAMILIES: dict[str, Family] = {f.name: f for f in (QWEN2, QWEN3, LLAMA, MISTRAL)}


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; expected one of {', '.join(FAMILIES)}") from None
