"""The recipe's embedded base for the slow lane, rebuilt from scratch while the rest of the suite runs.

The repository ships the recipe's base (trainer/embedded/base_gsm8k, weights pinned in trainer/embedded/basemodel.py), so a
clone's `make gsm8k` starts RL at once; the slow lane checks that the shipped base is what the recipe
builds. Building it takes 7-11 minutes on the one thread the build uses, so when a collected test asks
for the `recipe_base` fixture, a child process starts building it at collection, on the core the other
tests leave free, and those tests are moved to the end of the run; the fixture waits for the child. It
is the same `ensure_base` a user's first run would call without the shipped copy (`use_shipped=False`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURE = "recipe_base"
#: the build's own time limit (a quiet core needs about 8 minutes; a loaded CI box up to about 20)
TIMEOUT_S = 3000

_BUILD = """
import os, sys, threading, time
parent = os.getppid()
def _orphaned():  # the test run ended without stopping us (SIGKILL, a CI timeout): stop too
    while os.getppid() == parent:
        time.sleep(2)
    os._exit(1)
threading.Thread(target=_orphaned, daemon=True).start()
from pathlib import Path
from trainer.embedded.basemodel import ensure_base
from trainer.config import resolve
from worker_contract.tasks import get_task
cfg = resolve("gsm8k", env={}, overrides={"run": "slow-lane-base"}, embedded=True)
report = ensure_base(cfg.embedded.base, get_task(cfg.task), Path(sys.argv[1]), max_new_tokens=cfg.algo.max_new_tokens,
                     eval_problems=cfg.embedded.eval_problems, use_shipped=False, show_progress=True)
print(f"base {report.path}: held-out {report.heldout_accuracy:.4f} after {report.sft_steps} steps, {report.sft_seconds} s")
"""


class _Build:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="stoa-recipe-base-"))
        self.log = self.dir / "build.log"
        (self.dir / "home").mkdir()  # what it might save under ~ stays out of the user's home
        env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(self.dir / "home")}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-c", _BUILD, str(self.dir / "cache")], cwd=REPO, env=env,
                                         stdout=out, stderr=subprocess.STDOUT)

    def wait(self) -> Path:
        try:
            rc = self.proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"building the recipe's base took over {TIMEOUT_S} s; its log:\n{self.tail()}")
        if rc != 0:
            pytest.fail(f"building the recipe's base failed (exit {rc}); its log:\n{self.tail()}")
        return self.dir / "cache"

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_build: _Build | None = None


@pytest.hookimpl(trylast=True)  # after -m / -k have deselected what will not run
def pytest_collection_modifyitems(config, items):
    """Start the build if a collected test needs it, and run those tests last."""
    global _build
    needing = [item for item in items if FIXTURE in getattr(item, "fixturenames", ())]
    if not needing or config.option.collectonly:
        return
    items[:] = [item for item in items if item not in needing] + needing
    if _build is None:
        _build = _Build()


def pytest_sessionfinish(session, exitstatus):
    if _build is not None:
        _build.stop()


@pytest.fixture(scope="session")
def recipe_base() -> Path:
    """A cache directory holding the recipe's embedded base, built from scratch in this session."""
    if _build is None:  # collected some other way: build it now
        raise pytest.UsageError("the recipe_base fixture is started at collection (tests/recipe_base.py)")
    return _build.wait()
