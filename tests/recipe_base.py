"""The recipe's embedded base for the slow lane, rebuilt from scratch while the rest of the suite runs.

The repository ships the recipe's base (embedded/base_gsm8k), so a clone's `make gsm8k` starts
RL at once; the slow lane checks that the shipped base is what the recipe builds. Building it takes 7-11
minutes on one thread, so a child process starts it at collection, on a core the other tests leave free,
and the tests that need it run last. It is the same `ensure_base` a user's first run calls without the
shipped copy. Under pytest-xdist the controller owns the one build and every worker waits for its exit
status. Where torch or the CPU's vector capability differ from the shipped base's (`_elsewhere`), the
build could not match, so it is not started and the test is skipped with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURE = "recipe_base"
#: the build's own time limit (a quiet core needs about 8 minutes; a loaded CI box up to about 20)
TIMEOUT_S = 3000
#: workerinput key: the folder where an xdist controller's build lives
SHARED = "stoa_recipe_base_dir"

_BUILD = """
import os, sys, threading, time
parent = os.getppid()
def _orphaned():  # the test run ended without stopping us (SIGKILL, a CI timeout): stop too
    while os.getppid() == parent:
        time.sleep(2)
    os._exit(1)
threading.Thread(target=_orphaned, daemon=True).start()
from pathlib import Path
from embedded.basemodel import ensure_base
from embedded.config import resolve_embedded
from worker_contract.tasks import get_task
cfg = resolve_embedded("gsm8k", env={}, overrides={"run": "slow-lane-base"})
report = ensure_base(cfg.embedded.base, get_task(cfg.task), Path(sys.argv[1]), max_new_tokens=cfg.algo.max_new_tokens,
                     eval_problems=cfg.embedded.eval_problems, use_shipped=False, show_progress=True)
print(f"base {report.path}: held-out {report.heldout_accuracy:.4f} after {report.sft_steps} steps, {report.sft_seconds} s")
"""


class _Build:
    """The build in `dir`: a child process (started by `start`, in the process that owns it) whose exit
    status a thread writes to `dir/rc`, so any process of the run can wait for it by that file."""

    def __init__(self, folder: Path | None = None) -> None:
        self.dir = folder or Path(tempfile.mkdtemp(prefix="stoa-recipe-base-"))
        self.log = self.dir / "build.log"
        self.rc_file = self.dir / "rc"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        (self.dir / "home").mkdir(exist_ok=True)  # what it might save under ~ stays out of the user's home
        env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(self.dir / "home")}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-c", _BUILD, str(self.dir / "cache")], cwd=REPO, env=env,
                                         stdout=out, stderr=subprocess.STDOUT)
        threading.Thread(target=self._record_exit, daemon=True).start()

    def _record_exit(self) -> None:
        rc = self.proc.wait()
        tmp = self.rc_file.with_suffix(".tmp")
        tmp.write_text(str(rc))
        tmp.replace(self.rc_file)

    def wait(self) -> Path:
        deadline = time.monotonic() + TIMEOUT_S
        while not self.rc_file.exists():
            if time.monotonic() > deadline:
                pytest.fail(f"building the recipe's base took over {TIMEOUT_S} s; its log:\n{self.tail()}")
            time.sleep(1)
        rc = int(self.rc_file.read_text())
        if rc != 0:
            pytest.fail(f"building the recipe's base failed (exit {rc}); its log:\n{self.tail()}")
        return self.dir / "cache"

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else "(no log yet)"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


#: the build this process owns (single process or xdist controller), or waits for (xdist worker)
_build: _Build | None = None
#: set when the build would be spent for nothing here (`_elsewhere`); the fixture skips with it
_skip_reason: str | None = None


def _elsewhere() -> str | None:
    """Why building here cannot check the shipped bits, or None. A build's last bits follow torch and the CPU's
    vector capability (BaseReport.built_on), so on another one the comparison can only end in "other bits by
    design" after 8-20 minutes of a core; the building itself is covered by test_basemodel's short configs.
    DRL_RECIPE_BASE_BUILD=always builds anyway (the comparison then xfails)."""
    if os.environ.get("DRL_RECIPE_BASE_BUILD", "") == "always":
        return None
    from embedded.basemodel import SHIPPED_BASE, BaseReport, build_environment

    shipped = BaseReport.model_validate_json((SHIPPED_BASE / "base.json").read_text()).built_on
    here = build_environment()
    if here == shipped:
        return None
    return (f"the shipped base was built under {shipped} and this machine is {here}: its build could not match "
            "the shipped bits (DRL_RECIPE_BASE_BUILD=always builds it anyway)")


def _worker_dir(config) -> Path | None:
    """On an xdist worker, the controller's build folder."""
    folder = getattr(config, "workerinput", {}).get(SHARED)
    return Path(folder) if folder else None


def schedule(config, items) -> None:
    """Start the build if a collected test needs it (an xdist worker asks its controller to), and run those
    tests last. Called by conftest's pytest_collection_modifyitems once -m / -k have deselected."""
    global _build, _skip_reason
    needing = [item for item in items if FIXTURE in getattr(item, "fixturenames", ())]
    if not needing or config.option.collectonly:
        return
    _skip_reason = _elsewhere()
    if _skip_reason is not None:
        return
    items[:] = [item for item in items if item not in needing] + needing
    if _build is not None:
        return
    shared = _worker_dir(config)
    if shared is not None:
        _build = _Build(shared)
        (shared / "wanted").touch()  # read by the controller once this worker's collection is finished
    else:
        _build = _Build()
        _build.start()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist controller: one build folder for the run, named to every worker."""
    global _build
    if _build is None:
        _build = _Build()
    node.workerinput[SHARED] = str(_build.dir)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """xdist controller: the first worker that collected a test needing the base starts the one build."""
    if _build is not None and _build.proc is None and (_build.dir / "wanted").exists():
        _build.start()


def pytest_sessionfinish(session, exitstatus):
    if _build is not None and _worker_dir(session.config) is None:  # the owner stops it and removes the folder
        _build.stop()


@pytest.fixture(scope="session")
def recipe_base() -> Path:
    """A cache directory holding the recipe's embedded base, built from scratch in this session."""
    if _skip_reason is not None:
        pytest.skip(_skip_reason)
    if _build is None:  # collected some other way: build it now
        raise pytest.UsageError("the recipe_base fixture is started at collection (tests/recipe_base.py)")
    return _build.wait()
