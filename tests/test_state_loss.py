"""Local state that cannot be made again (a run's signing key, its checkpoints) is never deleted under a
running run, and a plan that deletes it says so: `make clean STATE=1` while a run holds its lock, and
teardown's plan for a purge."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
from pathlib import Path

from infra.boxops import teardown_actions

REPO = Path(__file__).resolve().parent.parent


def _tree(tmp_path: Path) -> Path:
    """The Makefile and the stdlib code its clean target runs, in a scratch tree with one local run."""
    root = tmp_path / "tree"
    root.mkdir()
    shutil.copy(REPO / "Makefile", root)
    for pkg in ("infra", "worker_contract"):
        shutil.copytree(REPO / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    run = root / ".stoa" / "runs" / "live-run"
    run.mkdir(parents=True)
    (run / "trainer.key").write_text("key")
    return root


def test_make_clean_state_refuses_while_a_run_holds_its_lock(tmp_path):
    root = _tree(tmp_path)
    with open(root / ".stoa" / "runs" / "live-run" / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # what a running `make gsm8k RUN=live-run` holds
        r = subprocess.run(["make", "clean", "STATE=1"], cwd=root, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "live-run" in r.stderr and "nothing removed" in r.stderr, r.stdout + r.stderr
        assert "invoke stop --run live-run --local" in r.stderr, r.stderr  # the run named, not RUN
        assert (root / ".stoa" / "runs" / "live-run" / "trainer.key").exists()
    r = subprocess.run(["make", "clean", "STATE=1"], cwd=root, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not (root / ".stoa").exists(), r.stdout + r.stderr


def test_teardown_plan_says_the_key_goes(tmp_path):
    root = _tree(tmp_path)
    (root / ".stoa" / "runs" / "live-run" / "metrics.jsonl").write_text("{}\n")
    purge = [a for a in teardown_actions(str(root), "live-run", purge=True) if a.startswith("delete")]
    assert len(purge) == 1 and "trainer.key" in purge[0] and "never resume" in purge[0], purge
    assert "its metrics" in purge[0]
