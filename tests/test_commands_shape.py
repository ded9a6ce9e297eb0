"""Commands only speak: every function in commands/*.py is short, its work done in estimate/, runtime/ or infer/.

A command parses its options (typer's signature, however many options it has), calls the function that does the
work and prints what comes back (a table, or --json). The cap counts the body: the lines from the first statement
after the docstring to the end, so a long option list is not counted against it."""

from __future__ import annotations

import ast
from pathlib import Path

COMMANDS = Path(__file__).resolve().parents[1] / "src" / "trainscale" / "commands"
MAX_BODY_LINES = 60


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = node.body
    if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return node.end_lineno - body[0].lineno + 1


def test_no_command_function_body_over_60_lines():
    long = []
    for p in sorted(COMMANDS.glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and body_lines(node) > MAX_BODY_LINES:
                long.append(f"{p.name}:{node.lineno} {node.name} ({body_lines(node)} lines)")
    assert long == []


def test_the_counter_counts_the_body_only():
    tree = ast.parse('def f(\n    a=1,\n    b=2,\n):\n    """Doc\n    string."""\n    x = a\n    return x + b\n')
    assert body_lines(tree.body[0]) == 2
