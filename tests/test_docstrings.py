"""Module docstrings stay short: at most 10 lines saying what the module is for and why; usage detail, design
notes and measurements live in docs/ (each doc has a section naming the module). Read with ast; nothing is
imported. That the paths docs name exist is tests/test_docs_paths.py's job."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("trainer", "worker_contract", "infra", "entrypoints", "bench", "tests")
TOP_FILES = ("noxfile.py", "tasks.py")
MAX_LINES = 10


def _files() -> list[Path]:
    out = [ROOT / f for f in TOP_FILES if (ROOT / f).exists()]
    for folder in FOLDERS:
        out += [p for p in sorted((ROOT / folder).rglob("*.py"))
                if not any(part.startswith(".") or part.endswith(".egg-info") for part in p.relative_to(ROOT).parts)]
    return out


def docstring_lines(path: Path) -> int:
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
    return len(doc.strip().splitlines()) if doc else 0


def test_module_docstrings_are_at_most_10_lines():
    long = []
    for p in _files():
        rel = p.relative_to(ROOT).as_posix()
        n = docstring_lines(p)
        if n > MAX_LINES:
            long.append(f"{rel}: {n} lines")
    assert not long, (f"module docstrings over {MAX_LINES} lines (keep what and why; move the rest to docs/):\n"
                      + "\n".join(long))

