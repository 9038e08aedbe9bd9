"""What every benchmark result carries: the machine, the software, and the commit it measured."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def git_commit() -> str:
    """HEAD (with -dirty), or STOA_COMMIT where the tree was copied without .git (a rented GPU box)."""
    if os.environ.get("STOA_COMMIT"):
        return os.environ["STOA_COMMIT"]
    if not _own_repository():
        return "unknown"
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=RESULTS.parent, capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=RESULTS.parent,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _own_repository() -> bool:
    """Whether the tree these benchmarks sit in is a git checkout's top level. A copy of it inside another
    checkout (a `git archive` under an ignored folder of a clone) would otherwise report that clone's HEAD
    and status, which describe other code."""
    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=RESULTS.parent, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and Path(out.stdout.strip()).resolve() == RESULTS.parent.parent.resolve()


def provenance() -> dict:
    """The tree a run measures: HEAD, `git status --porcelain` (untracked files too) and whether it is clean.
    Where there is no git (a tree copied without .git) the commit is STOA_COMMIT or 'unknown' and `clean` is
    None: not known, never assumed."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=RESULTS.parent, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    head, status = (git("rev-parse", "HEAD"), git("status", "--porcelain")) if _own_repository() else (None, None)
    if head is None or status is None:
        # the sender's word for a copied tree: STOA_COMMIT (the full hash) and STOA_CLEAN=1 where its
        # `git status --porcelain` was empty when it was sent
        clean = True if os.environ.get("STOA_CLEAN") == "1" and os.environ.get("STOA_COMMIT") else None
        return {"commit": os.environ.get("STOA_COMMIT", "unknown"), "status_porcelain": "" if clean else None,
                "clean": clean}
    return {"commit": head, "status_porcelain": status, "clean": status == ""}


def command(argv: list[str] | None = None, module: str | None = None) -> str:
    """The command line that ran this benchmark. With argv (what the benchmark's main got; tests call main
    in-process): `python -m <module> <argv>`. Without: this process's own, `python -m <its module> ...` or
    `python <script> ...`."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if argv is not None:
        if module in (None, "__main__") and spec is not None:
            module = spec.name.removesuffix(".__main__")
        return shlex.join(["python", "-m", module or "unknown", *argv])
    if spec is not None:
        return shlex.join(["python", "-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]])
    return shlex.join(["python", *sys.argv])


def validation_problems(task, n: int) -> list:
    """`n` problems to stop or choose a supervised base on, never the test split (whose accuracy is what RL's
    held-out figures report): training problems from index 10**8 on, which supervision cycling through the
    training split from index 0 never reaches. Only for a generated training split of at least 10**9."""
    train = task.dataset("train")
    if len(train) < 10**9:
        raise ValueError(f"the {task.name} training split has {len(train)} problems: carve its validation "
                         "problems out before supervising on it")
    return train[10**8:10**8 + n]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    prov = provenance()
    info = {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "commit": prov["commit"], "clean": prov["clean"],
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        info["torch"] = None
    try:
        import numpy

        info["numpy"] = numpy.__version__
    except ImportError:
        pass
    return info


def write_result(name: str, result: dict, path: str | Path | None = None, argv: list[str] | None = None,
                 module: str | None = None, tree: dict | None = None) -> Path:
    """bench/results/<name>.json with the tree (commit, clean, status), the machine and the command line
    (`argv` as the benchmark's main got it, else sys.argv): what tests/test_bench_results.py asks of every file.
    A long benchmark passes `tree`, the `provenance()` it took when it started: the checkout may move on
    while it runs, and the result describes the code that ran."""
    out = Path(path) if path else RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    caller = module or sys._getframe(1).f_globals.get("__name__")
    tree = tree or provenance()
    machine = {**machine_info(), "commit": tree["commit"], "clean": tree["clean"]}
    doc = {"benchmark": name, **tree, "machine": machine, "command": command(argv, caller), **result}
    out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return out
