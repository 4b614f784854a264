"""A calculator tool for SmolLM2's multi-turn example (``multiturn.yaml``).

A plain Python function with type hints and a Google-style docstring: that is all a tool needs
(its JSON schema for the chat template comes from ``transformers.utils.get_json_schema``). It
runs in lppo's tool worker process, so it must be importable from a module (this file, with
``examples/smollm2`` on ``PYTHONPATH``).
"""

from __future__ import annotations

import ast
import operator

_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
}


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported expression element {ast.dump(node)[:40]}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with +, -, * and / (e.g. "37 * 48").

    Args:
        expression: the arithmetic expression to evaluate.
    """
    value = _evaluate(ast.parse(expression, mode="eval").body)
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"
