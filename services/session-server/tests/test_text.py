"""Tokenizer and chat templates: text becomes the right IDs once; templates render in a sandbox."""

import json

import pytest

from rlfleet.common.chat import CHAT_TEMPLATE, render_messages
from rlfleet.session.text import ChatRenderer, Tokenizer, load_chat_renderer, model_context_length

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]

# The shape of Qwen2.5's template: a default system prompt when the conversation does not start with one.
DEFAULT_SYSTEM_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{%- endif %}"
    + CHAT_TEMPLATE)


def test_special_tokens_in_text_map_to_their_ids_and_nothing_is_added(tokenizer_dir):
    tokenizer = Tokenizer(str(tokenizer_dir))
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2  # <|im_start|>, <|im_end|>: one id each
    assert 0 not in ids  # no <|endoftext|> appended
    assert tokenizer.decode(ids) == "user\nhi"  # special tokens are not shown to the parser


def test_ids_outside_the_vocabulary_are_found_with_their_position(tokenizer_dir):
    tokenizer = Tokenizer(str(tokenizer_dir))
    assert tokenizer.invalid_id([1, 2, 3]) is None
    assert tokenizer.invalid_id([1, tokenizer.vocab_size, 2]) == (1, tokenizer.vocab_size)
    assert tokenizer.invalid_id([-1]) == (0, -1)


def test_the_models_jinja_template_renders_like_the_builtin_chatml(tokenizer_dir):
    renderer = load_chat_renderer(str(tokenizer_dir), "auto")
    assert renderer.uses_model_template
    for generation_prompt in (True, False):
        assert renderer.render(MESSAGES, generation_prompt) == render_messages(MESSAGES, generation_prompt)
    assert not load_chat_renderer(str(tokenizer_dir), "builtin").uses_model_template


def test_an_observation_is_rendered_as_a_continuation_without_the_templates_conversation_start():
    renderer = ChatRenderer(DEFAULT_SYSTEM_TEMPLATE, {})
    tool = [{"role": "tool", "content": "5"}]
    assert renderer.render(tool, False).startswith("<|im_start|>system\nYou are helpful.")
    assert (renderer.render_continuation(tool, True)
            == "<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")


def test_templates_run_sandboxed_and_their_errors_are_value_errors():
    escape = ChatRenderer("{{ messages.__class__.__mro__[1].__subclasses__() }}", {})
    with pytest.raises(ValueError, match="chat template"):
        escape.render(MESSAGES, False)
    strict = ChatRenderer("{{ raise_exception('roles must alternate') }}", {})
    with pytest.raises(ValueError, match="roles must alternate"):
        strict.render(MESSAGES, False)
    with pytest.raises(ValueError, match="unknown chat role 'robot'"):
        ChatRenderer(None, {}).render([{"role": "robot", "content": "x"}], False)


def test_context_length_comes_from_the_model_config_then_the_tokenizer_config(tmp_path):
    assert model_context_length(str(tmp_path)) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 2048}))
    assert model_context_length(str(tmp_path)) == 2048
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 1024}))
    assert model_context_length(str(tmp_path)) == 1024
