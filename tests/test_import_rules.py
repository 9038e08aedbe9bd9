"""The house's import rules, read from the code itself (ast, nothing imported):

    worker_contract -> nothing of ours       (the contract both sides share)
    trainer         -> worker_contract only  (the learner; its models live in trainer/models/)
    infra           -> trainer, worker_contract
    embedded        -> infra, trainer, worker_contract (the local runs; nothing below imports them)
    entrypoints/, tasks.py, noxfile.py, bench/ -> anything
More in docs/map.md (module notes).
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("worker_contract", "trainer", "infra", "embedded", "entrypoints", "bench")
TOP_FILES = ("tasks.py", "noxfile.py")
#: what each top-level unit may import (None: anything of ours)
ALLOWED: dict[str, set[str] | None] = {
    "worker_contract": set(),
    "trainer": {"worker_contract"},
    "infra": {"trainer", "worker_contract"},
    "embedded": {"infra", "trainer", "worker_contract"},
    "entrypoints": None, "bench": None, "tasks": None, "noxfile": None,
}
#: file -> the process mains above it that it may name as a `python -m` command, never import (an argv string):
#: the old commands' shims re-execute their entry point, and infra.native_launch's LEARNER_MODULE is the learner
#: process both launchers start
SHIMS = {"trainer.launch": {"entrypoints.launch"}, "trainer.native.__main__": {"entrypoints.learner"},
         "infra.native_launch": {"entrypoints.learner"}}
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+(:[A-Za-z_]\w*)?")


def our_files() -> dict[str, Path]:
    """module name -> file, for every .py file of our packages and the top-level entry files."""
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for name in TOP_FILES:
        out[name[:-3]] = REPO / name
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest module of ours that `name` (a module, or module.attribute) falls in."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return None


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(modules of ours this file imports, modules of ours it names in strings)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                base_name = ".".join(base + ([node.module] if node.module else []))
            else:
                base_name = node.module or ""
            for a in node.names:  # `from pkg import mod` imports the module pkg.mod when there is one
                sub = f"{base_name}.{a.name}"
                found.add(sub if sub in modules else base_name)
    imported = {m for m in (_resolve(n, modules) for n in found) if m and m != module}
    skip = _docstrings(tree)
    named: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            if _DOTTED.fullmatch(node.value):
                target = _resolve(node.value.split(":")[0], modules)
                if target and target != module and "." in node.value.split(":")[0]:
                    named.add(target)
    return imported, named


def unit(module: str) -> str:
    return module.split(".")[0]


@functools.cache
def graph() -> tuple[dict[str, Path], dict[str, set[str]], dict[str, set[str]]]:
    modules = our_files()
    imports, strings = {}, {}
    for m, p in modules.items():
        imports[m], strings[m] = imports_of(m, p, modules)
    return modules, imports, strings


def layer_violations(modules, imports, strings) -> list[str]:
    bad = []
    for m in sorted(modules):
        allowed = ALLOWED[unit(m)]
        if allowed is None:
            continue
        for how, targets in (("imports", imports[m]), ("names", strings[m])):
            for t in sorted(targets):
                if unit(t) != unit(m) and unit(t) not in allowed and t not in SHIMS.get(m, ()):
                    bad.append(f"{modules[m].relative_to(REPO)} {how} {t} ({unit(m)} may import "
                               f"{', '.join(sorted(allowed)) or 'nothing of ours'})")
    return bad


def cycles(imports: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one file (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(imports.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(imports):
        if v not in index:
            visit(v)
    return out


def test_the_scan_sees_the_imports_it_must():
    """The reader itself: relative, in-function and string imports are found (a blind scan passes anything)."""
    modules, imports, strings = graph()
    assert "trainer.models.registry" in imports["trainer.models.model"]       # from .registry import ...
    assert "trainer.models.lfm2_layers" in imports["trainer.models.lfm2"]     # inside a method
    assert "infra.launch_gpu" in imports["entrypoints.launch"]                # inside a function
    assert "trainer.backends.hf" in strings["trainer.backends"]               # "module:Class" registry
    assert {unit(m) for m in modules} == set(ALLOWED) and len(modules) > 100


def test_layers():
    bad = layer_violations(*graph())
    assert not bad, "imports against the house's layers:\n" + "\n".join(bad)


def test_no_import_cycles_between_files():
    _, imports, _ = graph()
    found = cycles(imports)
    assert not found, "files that import each other:\n" + "\n".join(" <-> ".join(c) for c in found)
