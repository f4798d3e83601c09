"""The shipped example: arithmetic with a calculator tool, multi-turn, with a verifiable reward.

The agent asks the model to use a calculator by writing `CALC: <expression>` (a tool call as
text, so that turns merge into one training sequence on templates that drop API tool calls,
as SmolLM2's does), answers it with `RESULT: <value>`, and stops at `ANSWER: <number>` or after
MAX_TURNS. `score` gives 1.0 when the final answer is the task's `answer`, else 0.0.
Run it: `rl-proxy collect harness_adapters/examples/arithmetic/collect.yaml`.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable
from typing import Any

SYSTEM = (
    "You solve arithmetic problems with a calculator. To use the calculator, write one line "
    "'CALC: <expression>', for example 'CALC: 12 * 7', and wait for the result. "
    "When you know the answer, write one line 'ANSWER: <number>'."
)
# One worked example: without it SmolLM2-135M solves ~4% of the training tasks (it rarely uses
# the calculator), with it ~60% at temperature 1: room for RL to improve on.
DEMO = [
    {"role": "user", "content": "What is 3 + 4?"},
    {"role": "assistant", "content": "CALC: 3 + 4"},
    {"role": "user", "content": "RESULT: 7"},
    {"role": "assistant", "content": "ANSWER: 7"},
]
MAX_TURNS = 3
CALC = re.compile(r"CALC:\s*([-+*/() 0-9.]+)")
ANSWER = re.compile(r"ANSWER:\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")
BINARY: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def calculate(expression: str) -> str:
    """The calculator: + - * / and parentheses on numbers, nothing else."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
            return BINARY[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("unsupported")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (ValueError, SyntaxError, ZeroDivisionError):
        return "error"
    return str(int(result)) if float(result).is_integer() else f"{result:.4g}"


async def agent(client: Any, task: Any, model: str) -> str:
    """One episode; returns the final answer (or the last reply, if there was none)."""
    messages = [{"role": "system", "content": SYSTEM}, *DEMO, {"role": "user", "content": task.prompt}]
    reply = ""
    for _ in range(MAX_TURNS):
        answer = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=int(task.data.get("max_tokens", 40)),
            temperature=float(task.data.get("temperature", 1.0)),
        )
        reply = answer.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": reply})
        if found := ANSWER.search(reply):
            return found.group(1).replace(",", "")
        if found := CALC.search(reply):
            messages.append({"role": "user", "content": f"RESULT: {calculate(found.group(1))}"})
        else:
            messages.append({"role": "user", "content": "Write 'CALC: <expression>' or 'ANSWER: <number>'."})
    return reply


def score(task: Any, outcome: Any) -> float:
    try:
        return float(float(outcome.output.strip()) == float(task.data["answer"]))
    except ValueError:
        return 0.0
