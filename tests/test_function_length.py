"""No function over 60 lines outside bench/ and tests/, read with ast; nothing is imported.

A function's length runs from its `def` line to its last line, nested functions and classes counted as part
of it. A long one is split into named helpers, each with one job, not listed here as an exception.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("worker_contract", "trainer", "infra", "embedded", "entrypoints")
TOP_FILES = ("noxfile.py", "tasks.py")
MAX_LINES = 60


def _files() -> list[Path]:
    out = [ROOT / f for f in TOP_FILES]
    for folder in FOLDERS:
        out += [p for p in sorted((ROOT / folder).rglob("*.py"))
                if not any(part.startswith(".") or part.endswith(".egg-info") for part in p.relative_to(ROOT).parts)]
    return out


def long_functions(tree: ast.AST, max_lines: int = MAX_LINES) -> list[tuple[str, int, int]]:
    """(qualified name, first line, lines) of each outermost function longer than `max_lines`; methods are
    named Class.method, and a function nested in another counts towards its parent only."""
    out: list[tuple[str, int, int]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                n = child.end_lineno - child.lineno + 1
                if n > max_lines:
                    out.append((prefix + child.name, child.lineno, n))
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)  # functions defined under an `if`, a `try`, ...

    walk(tree, "")
    return out


def test_long_functions_are_found():
    src = "class A:\n    def m(self):\n" + "        x = 1\n" * 3 + "def f():\n    def g():\n" + "        y = 2\n" * 3
    assert long_functions(ast.parse(src), max_lines=3) == [("A.m", 2, 4), ("f", 6, 5)]


def test_no_function_over_60_lines():
    long = []
    for p in _files():
        for name, line, n in long_functions(ast.parse(p.read_text(), filename=str(p))):
            long.append(f"{p.relative_to(ROOT).as_posix()}:{line} {name}: {n} lines")
    assert not long, (f"functions over {MAX_LINES} lines outside bench/ and tests/ (split each into named "
                      "helpers with one job):\n" + "\n".join(long))
