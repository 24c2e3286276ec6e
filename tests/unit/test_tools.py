"""Tool-call parsing and the calculator: both call formats, and no eval of model text."""

from __future__ import annotations

import pytest

from mismatch_probe.rollout.tools import ToolCall, calculate, parse_tool_calls, run_tool


@pytest.mark.parametrize(
    "expression, answer",
    [
        ("18 * 10 - 85", "95"),
        ("(3 + 4) * 2", "14"),
        ("7 / 2", "3.5"),
        ("9 / 3", "3"),
        ("-5 + 2", "-3"),
        ("2 ** 10", "1024"),
        ("2 ^ 3", "8"),
        ("17 // 5", "3"),
        ("17 % 5", "2"),
        ("1 / 3", "0.333333"),
        ("1.5 * 4", "6"),
    ],
)
def test_calculator_answers(expression, answer):
    assert calculate(expression) == answer


@pytest.mark.parametrize(
    "expression, error",
    [
        ("__import__('os').system('echo hi')", "only numbers"),
        ("open('x')", "only numbers"),
        ("1 / 0", "division by zero"),
        ("2 ** 1000", "exponent too large"),
        ("10 ** 20", "out of range"),
        ("1 +", "not an arithmetic expression"),
        ("x * 2", "only numbers"),
        ("'a' * 3", "only numbers"),
        ("1" * 300, "too long"),
        ("(-8) ** 0.5", "out of range"),
    ],
)
def test_calculator_refuses_everything_else(expression, error):
    result = calculate(expression)
    assert result.startswith("error:") and error in result


def test_both_call_formats_are_parsed():
    text = (
        "Let me calculate. <tool_call>calculator(18 * 10)</tool_call> and "
        '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call> '
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"3*3\\"}"}</tool_call>'
    )
    calls = parse_tool_calls(text)
    assert [c.arguments["expression"] for c in calls] == ["18 * 10", "2+2", "3*3"]
    assert [run_tool(c) for c in calls] == ["180", "4", "9"]


def test_bad_calls_become_error_strings_for_the_model():
    calls = parse_tool_calls(
        "<tool_call>{not json</tool_call><tool_call>???</tool_call>"
        '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
    )
    assert calls[0].startswith("error: could not parse") and calls[1].startswith("error: could not parse")
    assert isinstance(calls[2], ToolCall) and run_tool(calls[2]) == "error: unknown tool 'search'"
    assert run_tool(ToolCall("calculator", {"expression": 5}, "")) == "error: calculator needs an 'expression' string"
    assert parse_tool_calls("no call here") == []
