"""Process mains: one learner main, and the process mains of trainer/ live in entrypoints/ (read with ast).

- exactly one function under trainer/ and entrypoints/ calls `run_learner` (trainer.native.learner.serve), and one
  process main calls that: entrypoints/learner.py. A second learner main fails here;
- a `__main__` block under trainer/ only re-executes `python -m entrypoints.<name>` (an old command's shim);
- both launchers' learner command is the one `python -m entrypoints.learner` accepts (a real process).
More in docs/map.md (process mains).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FOLDERS = ("trainer", "entrypoints")


def _modules() -> dict[str, ast.Module]:
    out = {}
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            # a package's __init__.py and __main__.py go by the package's name (what `python -m` takes)
            out[".".join(parts[:-1] if parts[-1] in ("__init__", "__main__") else parts)] = ast.parse(path.read_text())
    return out


def _name(func: ast.expr) -> str | None:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _dotted(node: ast.expr) -> str:
    return f"{_dotted(node.value)}.{node.attr}" if isinstance(node, ast.Attribute) else getattr(node, "id", "?")


def callers(name: str, imported_from: str | None = None) -> set[str]:
    """`module.function` (or `module` at top level) for each call of `name`; with `imported_from`, only in
    modules that import `name` from a module whose last part that is (`from .learner import serve`)."""
    out: set[str] = set()
    for module, tree in _modules().items():
        if imported_from is not None and not any(
                isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[-1] == imported_from
                and any(a.name == name for a in n.names) for n in ast.walk(tree)):
            continue

        def visit(node: ast.AST, where: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    visit(child, f"{where}.{child.name}")
                    continue
                if isinstance(child, ast.Call) and _name(child.func) == name:
                    out.add(where)
                visit(child, where)

        visit(tree, module)
    return out


def main_blocks() -> dict[str, ast.If]:
    """module -> its `if __name__ == "__main__":` block."""
    out = {}
    for module, tree in _modules().items():
        for node in tree.body:
            if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                    and _dotted(node.test.left) == "__name__"
                    and isinstance(node.test.comparators[0], ast.Constant)
                    and node.test.comparators[0].value == "__main__"):
                out[module] = node
    return out


def reexecuted(block: ast.If) -> str | None:
    """The entry point a shim's block re-executes (`os.execv(sys.executable, [sys.executable, "-m", M,
    *sys.argv[1:]])`, optionally after `os.environ.setdefault(...)`), or None if the block does more."""
    calls = [n for n in ast.walk(block) if isinstance(n, ast.Call)]
    if any(_dotted(c.func) not in ("os.execv", "os.environ.setdefault") for c in calls):
        return None
    execs = [c for c in calls if _dotted(c.func) == "os.execv"]
    if len(execs) != 1 or not isinstance(argv := execs[0].args[1], ast.List) or len(argv.elts) != 4:
        return None
    m, module, rest = argv.elts[1], argv.elts[2], argv.elts[3]
    if not (isinstance(m, ast.Constant) and m.value == "-m" and isinstance(module, ast.Constant)
            and isinstance(rest, ast.Starred)):
        return None
    return module.value


def test_one_learner_main():
    assert callers("run_learner") == {"trainer.native.learner.serve"}, (
        "the learner process's work is trainer.native.learner.serve; a second caller of run_learner is a second "
        "learner main")
    assert callers("serve", imported_from="learner") == {"entrypoints.learner.main"}
    assert "entrypoints.learner" in main_blocks()


def test_process_mains_of_trainer_are_shims_of_entrypoints():
    blocks = main_blocks()
    shims = {m: reexecuted(b) for m, b in blocks.items() if m.startswith("trainer.")}
    bad = sorted(m for m, target in shims.items() if target is None)
    assert not bad, f"process mains under trainer/ (give each a thin file in entrypoints/): {bad}"
    for module, target in shims.items():
        assert target in blocks and target.startswith("entrypoints."), (module, target)
    # the old commands the docs, closed issues and users' notes name
    assert shims == {"trainer.launch": "entrypoints.launch", "trainer.native": "entrypoints.learner"}


def test_both_launchers_start_the_one_learner_command(tmp_path):
    from infra.native_launch import learner_argv, learner_command
    from infra.slime_launch import BoxPaths
    from trainer.config import resolve

    cfg = resolve("gsm8k", {}, {"run": "one-learner-1"})
    native = learner_command(cfg, BoxPaths(remote_dir=str(tmp_path), run=cfg.run), sys.executable)
    embedded = learner_argv(sys.executable, tmp_path / "recipe.json", tmp_path, tmp_path)  # embedded/localprocs.py
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for argv in (native, embedded):
        assert argv[1:3] == ["-m", "entrypoints.learner"]
        # the parser takes every flag; the missing recipe is one sentence and exit 2 (nothing started)
        p = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and "recipe.json: No such file or directory" in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and "usage" not in p.stderr, p.stderr
