"""Tool calls in model output, and the calculator tool.

Two call formats are understood, both inside ``<tool_call>...</tool_call>`` tags:

* the fixture's ``calculator(EXPRESSION)``;
* the common JSON form ``{"name": "calculator", "arguments": {"expression": "..."}}`` (Qwen/Hermes
  style; ``arguments`` may also be a JSON-encoded string).

The calculator evaluates arithmetic by walking a parsed AST (numbers, + - * / // % **, unary
signs, parentheses); model text is never passed to ``eval``. Anything else comes back to the model
as an error string, as a real tool server would answer.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from dataclasses import dataclass

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
FUNCTION_STYLE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*\((.*)\)\s*$", re.DOTALL)
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e15


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    raw: str  # the text between the tags


def parse_tool_calls(text: str) -> list[ToolCall | str]:
    """Every ``<tool_call>`` block in ``text``: a :class:`ToolCall`, or an error string for a block
    that is neither format (the model gets that string back as the tool's answer)."""
    out: list[ToolCall | str] = []
    for block in TOOL_CALL.findall(text):
        body = block.strip()
        if body.startswith("{"):
            try:
                obj = json.loads(body)
                args = obj.get("arguments", {})
                if isinstance(args, str):
                    args = json.loads(args)
                if not isinstance(obj.get("name"), str) or not isinstance(args, dict):
                    raise ValueError
                out.append(ToolCall(obj["name"], args, block))
            except (ValueError, AttributeError):
                out.append(f"error: could not parse tool call {body[:80]!r}")
            continue
        m = FUNCTION_STYLE.match(body)
        if m:
            out.append(ToolCall(m.group(1), {"expression": m.group(2).strip()}, block))
        else:
            out.append(f"error: could not parse tool call {body[:80]!r}")
    return out


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    pass


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError("exponent too large")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise CalculatorError("result out of range")
        return value
    raise CalculatorError("only numbers and + - * / // % ** ( ) are allowed")


def calculate(expression: str) -> str:
    """The calculator's answer to ``expression``: a number, or ``error: ...``."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        return "error: expression too long"
    try:
        value = _eval(ast.parse(expression.replace("^", "**"), mode="eval"))
    except SyntaxError:
        return "error: not an arithmetic expression"
    except CalculatorError as exc:
        return f"error: {exc}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "error: result out of range"
        if value.is_integer():
            return str(int(value))
        return f"{value:.6g}"
    return str(value)


def run_tool(call: ToolCall | str) -> str:
    """The tool response for one parsed call (an error string for unknown tools or bad arguments)."""
    if isinstance(call, str):
        return call
    if call.name != "calculator":
        return f"error: unknown tool {call.name!r}"
    expression = call.arguments.get("expression")
    if not isinstance(expression, str):
        return "error: calculator needs an 'expression' string"
    return calculate(expression)
