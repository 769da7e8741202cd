"""A size a newcomer can read: no zerofn function over 80 lines of code (its docstring,
comments and blank lines not counted), read from the source."""

from __future__ import annotations

import ast
import pathlib

import zerofn

ROOT = pathlib.Path(zerofn.__file__).parent
MAX_FUNCTION_CODE_LINES = 80


def _code_lines(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = node.body
    has_doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    if has_doc and len(body) == 1:
        return 0
    start = body[1].lineno if has_doc else body[0].lineno
    text = lines[start - 1 : node.end_lineno]
    return sum(1 for line in text if line.strip() and not line.strip().startswith("#"))


def test_no_function_is_over_80_lines_of_code():
    long = {}
    for path in ROOT.rglob("*.py"):
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = _code_lines(lines, node)
                if n > MAX_FUNCTION_CODE_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = n
    assert long == {}
