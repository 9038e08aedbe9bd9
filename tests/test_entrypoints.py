"""Process mains: one learner main, and the process mains of trainer/ live in entrypoints/ (read with ast).

- exactly one function under trainer/ and entrypoints/ calls `run_learner` (trainer.native.learner.serve), and one
  process main calls that: entrypoints/learner.py. A second learner main fails here;
- trainer/ has no process main at all (no `__main__` block, no `__main__.py`): the old commands
  `python -m trainer.launch`, `trainer.native` and `trainer.psqa_eval` are gone, not re-executed;
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


def test_one_learner_main():
    assert callers("run_learner") == {"trainer.native.learner.serve"}, (
        "the learner process's work is trainer.native.learner.serve; a second caller of run_learner is a second "
        "learner main")
    assert callers("serve", imported_from="learner") == {"entrypoints.learner.main"}
    assert "entrypoints.learner" in main_blocks()


def test_trainer_has_no_process_main():
    blocks = main_blocks()
    assert {"entrypoints.launch", "entrypoints.learner", "entrypoints.psqa_eval"} <= set(blocks)
    mains = sorted(m for m in blocks if m.startswith("trainer."))
    assert not mains, f"process mains under trainer/ (give each a thin file in entrypoints/): {mains}"
    assert not list((REPO / "trainer").rglob("__main__.py"))


def test_the_old_commands_are_gone():
    """`python -m trainer.launch` and `python -m trainer.native` (old names of the launcher and the learner) run
    nothing now: Python refuses them (the commands are `python -m entrypoints.launch | learner`)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for old, why in (("trainer.launch", "No module named trainer.launch"),
                     ("trainer.native", "'trainer.native' is a package and cannot be directly executed")):
        # -S: this tree alone (an editable install of another checkout would answer for a module gone here)
        p = subprocess.run([sys.executable, "-S", "-m", old, "--help"], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 1 and why in p.stderr and not p.stdout, (old, p.returncode, p.stdout, p.stderr)


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
