"""Tool use: large multiplications that a tiny model can only get right with a calculator.

The prompt is a chat with the calculator tool declared; a correct episode calls
`calculator` with the expression, reads the <tool_response>, and answers with the number.
"""
from __future__ import annotations

import ast
import operator
import random
import re
import warnings

from loongsage.tasks.base import TaskRow, TaskSpec, draw_unique, register

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate_expression(expression: str, max_len: int = 200) -> str:
    """Evaluates + - * / // % and parentheses on numbers; anything else is a ValueError."""
    if len(expression) > max_len:
        raise ValueError(f"expression longer than {max_len} characters")
    try:
        with warnings.catch_warnings():  # e.g. "2if 3": a SyntaxWarning would reach the run's log
            warnings.simplefilter("error", SyntaxWarning)
            tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from exc

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if abs(left) > 1e50 or abs(right) > 1e50:
                raise ValueError("number too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported syntax in {expression!r}")

    try:
        value = ev(tree)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def generate(n: int, seed: int = 0, digits: int = 4, exclude: set[str] | None = None,
             tool_demo_rate: float = 1.0) -> list[TaskRow]:
    """`tool_demo_rate`: the share of rows whose SFT demonstration uses the calculator; the others answer
    directly (what a weak expert would do), so a bootstrapped policy calls the tool only sometimes."""
    if not 0.0 <= tool_demo_rate <= 1.0:
        raise ValueError(f"tool_demo_rate must be within [0, 1], got {tool_demo_rate}")
    rng = random.Random(seed)
    lo, hi = 10 ** (digits - 1), 10**digits - 1

    def draw() -> tuple[str, TaskRow]:
        x, y = rng.randint(lo, hi), rng.randint(lo, hi)
        question = f"{x}*{y}"
        demo = "tool" if random.Random(f"{seed}-{question}").random() < tool_demo_rate else "direct"
        return question, TaskRow(prompt=[{"role": "user", "content": f"{question}=?"}], answer=str(x * y),
                                 tag="calc", tools=[CALCULATOR_TOOL], meta={"expression": question, "demo": demo})

    return draw_unique(n, draw, exclude)


def reward(response: str, row: TaskRow) -> float:
    """1 when the last number in the final answer is the exact product."""
    numbers = re.findall(r"-?\d+", response)
    return 1.0 if numbers and numbers[-1] == row.answer else 0.0


def demonstration(row: TaskRow) -> list[dict]:
    """Call the calculator with the expression, then answer with its result (or, for rows marked
    `direct`, answer at once)."""
    if row.meta.get("demo") == "direct":
        return [{"role": "assistant", "content": row.answer}]
    call = {"id": "call_0", "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": row.meta["expression"]}}}
    return [{"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "name": "calculator", "content": row.answer},
            {"role": "assistant", "content": row.answer}]


SPEC = register(TaskSpec("calculator", "large multiplications with a calculator tool (chat)", generate, reward,
                         demonstration))
