"""Each family's tool-call format: what its template renders parses back to the same call,
malformed calls say why, and the built-in tags keep their meaning."""

from __future__ import annotations

import pytest

from rlfleet.common.families import FAMILIES
from rlfleet.common.tool_calls import FORMATS, ParsedCall, tool_call_format


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_rendered_call_parses_back_to_the_same_call(name):
    fmt = tool_call_format(name)
    text = fmt.render("calc", {"expression": "12*(3+4)"})
    (call,) = fmt.parse("Let me compute. " + text if name not in ("llama3_json",) else text)
    assert call.ok and call.name == "calc" and call.argument_text() == "12*(3+4)"
    assert fmt.parse("The answer is <answer>84</answer>") == []


def test_every_family_names_a_registered_format():
    assert {f.tool_call_format for f in FAMILIES.values()} <= set(FORMATS)


def test_hermes_reads_every_call_and_says_what_is_malformed():
    fmt = tool_call_format("hermes")
    text = ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": "{\\"y\\": 2}"}\n</tool_call>')
    assert [(c.name, c.arguments) for c in fmt.parse(text)] == [("a", {"x": 1}), ("b", {"y": 2})]
    assert "not closed" in fmt.parse('<tool_call>{"name": "a"')[0].error
    assert "not JSON" in fmt.parse("<tool_call>calc(1+2)</tool_call>")[0].error
    assert ("arguments must be a JSON object"
            in fmt.parse('<tool_call>{"name": "a", "arguments": 3}</tool_call>')[0].error)


def test_llama3_json_is_the_whole_turn_with_an_optional_python_tag():
    fmt = tool_call_format("llama3_json")
    (call,) = fmt.parse('<|python_tag|>{"name": "calc", "parameters": {"expression": "1+2"}}<|eot_id|>')
    assert (call.name, call.arguments) == ("calc", {"expression": "1+2"})
    assert fmt.parse("The result is 3.") == []
    assert "text after" in fmt.parse('{"name": "calc", "parameters": {}} and more')[0].error


def test_mistral_reads_a_list_of_calls_after_the_marker():
    fmt = tool_call_format("mistral")
    text = ('[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, '
            '{"name": "b", "arguments": {}, "id": "abc123def"}]</s>')
    assert [(c.name, c.arguments) for c in fmt.parse(text)] == [("a", {"x": 1}), ("b", {})]
    assert "not JSON" in fmt.parse("[TOOL_CALLS] calc(1)")[0].error


def test_tags_are_the_built_in_calc_calls():
    fmt = tool_call_format("tags")
    assert fmt.parse("<calc>1+2</calc> then <answer>3</answer>") == [
        ParsedCall("calc", {"input": "1+2"}, raw="<calc>1+2</calc>")]
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'"):
        tool_call_format("xml")
