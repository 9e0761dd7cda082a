import pytest

from rlfleet.envkit.actions import (
    FinalAnswer,
    InvalidCall,
    NoAction,
    ToolCall,
    parse_action,
    too_many_calls_error,
)

TOOLS = ["calc"]


@pytest.mark.parametrize(
    ("turn", "expected"),
    [
        ("<calc>37*48+5</calc>", ToolCall("calc", "37*48+5")),
        ("Let me compute. <calc>1+2</calc>", ToolCall("calc", "1+2")),
        ("<answer> 1781 </answer>", FinalAnswer("1781")),
        ("<answer>1</answer><answer>2</answer>", FinalAnswer("1")),
        ("<calc>1+2</calc><answer>3</answer>", ToolCall("calc", "1+2")),
        ("<answer>3</answer><calc>1+2</calc>", FinalAnswer("3")),
        ("I think it is 42.", NoAction()),
        ("", NoAction()),
    ],
)
def test_the_first_tag_of_a_turn_decides_its_action(turn, expected):
    assert parse_action(turn, TOOLS) == expected


@pytest.mark.parametrize(
    ("turn", "error"),
    [
        ("<calc>37*48+5", "error: malformed tool call: <calc> is not closed by </calc>"),
        ("<calc>37*48+5</answer>", "error: malformed tool call: <calc> is not closed by </calc>"),
        ("37*48+5</calc>", "error: malformed tool call: </calc> without <calc>"),
        ("<answer>12", "error: malformed tool call: <answer> is not closed by </answer>"),
        ("<python>print(1)</python>", "error: unknown tool 'python'; available: calc"),
    ],
)
def test_malformed_tags_and_unknown_tools_are_invalid_calls_with_an_error_observation(turn, error):
    action = parse_action(turn, TOOLS)
    assert isinstance(action, InvalidCall)
    assert action.error == error


def test_too_many_calls_error_names_the_limit():
    assert too_many_calls_error(3) == "error: tool call limit of 3 reached; give your <answer>"


@pytest.mark.parametrize(
    ("fmt", "turn", "expected"),
    [
        ("hermes", '<tool_call>\n{"name": "calc", "arguments": {"expression": "1+2"}}\n</tool_call>',
         ToolCall("calc", "1+2")),
        ("hermes", "The result is <answer>3</answer>", FinalAnswer("3")),
        ("hermes", '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>',
         InvalidCall("error: unknown tool 'search'; available: calc", tool="search")),
        ("llama3_json", '{"name": "calc", "parameters": {"expression": "4*4"}}', ToolCall("calc", "4*4")),
        ("llama3_json", "I do not know.", NoAction()),
        ("mistral", '[TOOL_CALLS] [{"name": "calc", "arguments": {"expression": "9-1"}}]',
         ToolCall("calc", "9-1")),
        ("mistral", "[TOOL_CALLS] calc(9-1)", InvalidCall(
            "error: malformed tool call: not JSON (Expecting value at 0)", tool="")),
        # The built-in tags mean nothing to a JSON format (and a JSON call nothing to the tags).
        ("hermes", "<calc>1+2</calc>", NoAction()),
        ("tags", '<tool_call>{"name": "calc"}</tool_call>', InvalidCall(
            "error: unknown tool 'tool_call'; available: calc", tool="tool_call")),
    ],
)
def test_a_family_s_own_format_decides_the_action(fmt, turn, expected):
    assert parse_action(turn, TOOLS, fmt) == expected
