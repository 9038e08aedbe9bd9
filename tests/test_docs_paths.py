"""The repository stands alone: every repository path that docs, docstrings and comments name exists, and
nothing cites files a clone does not have (design notes or research kept outside the repository)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP = ("worker_contract", "trainer", "infra", "entrypoints", "tests", "bench", "docs", "runs", ".ci")
#: a path under one of the top-level folders, as prose names it (`trainer/algo.py`, docs/pulse.md, ...)
_TOPS = "|".join(re.escape(t) for t in TOP)
PATH_RE = re.compile(rf"(?<![\w./-])((?:{_TOPS})/[\w./-]*[\w/])")
#: citations of files that live outside the repository
OUTSIDE_RE = re.compile(r"DESIGN(?:\.md)? section|STYLE(?:\.md)? rule|STYLE\.md|DESIGN\.md|research/\w+\.md|\.\./shared")
#: paths written at run time or on a GPU box, not in the tree
RUNTIME = ("bench/results/", "tests/.", "docs/_")
#: files whose paths are made-up trees they build (tests of the deploy's file selection)
FIXTURE_TREES = ("tests/test_remote.py", "tests/test_docs_paths.py")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [f for f in out.split() if f.endswith((".py", ".md", ".yaml", ".toml")) or f in ("Makefile", ".ci/run")]


def _exists(path: str) -> bool:
    path = path.split("::")[0].rstrip("./")
    if (ROOT / path).exists() or (ROOT / f"{path}.py").exists():
        return True
    # a name inside a module: `infra/slime_launch.runtime_env`, `trainer/slime_plugin/publish.hf_state`
    module, _, attr = path.rpartition(".")
    return bool(attr) and attr.isidentifier() and (ROOT / f"{module}.py").exists()


def test_every_named_repository_path_exists():
    missing = []
    for f in _tracked():
        if f in FIXTURE_TREES:
            continue
        for n, line in enumerate((ROOT / f).read_text(errors="replace").splitlines(), 1):
            for m in PATH_RE.finditer(line):
                path = m.group(1)
                if any(c in line[m.end():m.end() + 1] for c in "<{*") or path.startswith(RUNTIME):
                    continue
                if not _exists(path):
                    missing.append(f"{f}:{n}: {path}")
    assert not missing, "paths named but not in the repository:\n" + "\n".join(missing)


def test_nothing_cites_files_outside_the_repository():
    found = [f"{f}:{n}: {line.strip()[:120]}" for f in _tracked() if f != "tests/test_docs_paths.py"
             for n, line in enumerate((ROOT / f).read_text(errors="replace").splitlines(), 1)
             if OUTSIDE_RE.search(line)]
    assert not found, "citations of files outside the repository:\n" + "\n".join(found)
