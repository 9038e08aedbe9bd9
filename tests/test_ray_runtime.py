"""The Ray session never writes into HOME, whatever auth mode the environment hands it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

#: a trainer-like process: one Ray session, one task in a Ray worker, what each side saw
SESSION = """
import json, os, sys
import ray
from trainer.ray_runtime import ray_session

def worker_token():
    return os.environ.get("RAY_AUTH_TOKEN")

with ray_session(sys.argv[1], num_cpus=1):
    seen = {"mode": os.environ.get("RAY_AUTH_MODE"), "token": os.environ.get("RAY_AUTH_TOKEN"),
            "worker_token": ray.get(ray.remote(worker_token).remote())}
seen["token_after"] = os.environ.get("RAY_AUTH_TOKEN")
print("SEEN " + json.dumps(seen), flush=True)
"""


@pytest.mark.integration
def test_inherited_token_mode_keeps_the_token_in_memory_not_in_home(tmp_path):
    """A bare `ray.init()` (a test, a notebook, a library) leaves RAY_AUTH_MODE=token in its process's
    environment, and every process it starts inherits that. Ray then generates a token for the new local
    cluster and saves it to ~/.ray/auth_token; the session keeps token auth but the token in memory."""
    home, run_dir = tmp_path / "home", tmp_path / "run"
    home.mkdir()
    run_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "DRL_RAY_"))}
    env.update(HOME=str(home), RAY_AUTH_MODE="token", DRL_RAY_DASHBOARD="0", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", SESSION, str(run_dir)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(home.iterdir()) == []  # no ~/.ray/auth_token, nothing else either
    seen = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("SEEN "))[5:])
    assert seen["mode"] == "token" and len(seen["token"]) == 64
    assert seen["worker_token"] == seen["token"]  # the Ray processes got it by inheritance, not a file
    assert seen["token_after"] is None  # and it left the process's environment with the session
