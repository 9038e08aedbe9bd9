"""The Ray session never writes into HOME, whatever auth mode the environment hands it, runs its workers at
the trainer's priority, and a start that times out is made again."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from trainer.ray_runtime import _START_ATTEMPTS

REPO = Path(__file__).resolve().parent.parent

#: a trainer-like process: one Ray session, one task in a Ray worker, what each side saw
SESSION = """
import json, os, sys
import ray
from trainer.ray_runtime import ray_session, ray_tmpdir

def worker_token():
    return os.environ.get("RAY_AUTH_TOKEN"), os.nice(0)

with ray_session(sys.argv[1], num_cpus=1):
    seen = {"mode": os.environ.get("RAY_AUTH_MODE"), "token": os.environ.get("RAY_AUTH_TOKEN"),
            "worker": ray.get(ray.remote(worker_token).remote()),
            "ray_dir_mode": os.stat(ray_tmpdir(sys.argv[1])[0].parent).st_mode & 0o777}
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
    # no worker started with the node: the task's starts after the session's set-up, as an actor's may
    env.update(HOME=str(home), RAY_AUTH_MODE="token", DRL_RAY_DASHBOARD="0", PYTHONPATH=str(REPO),
               RAY_prestart_worker_first_driver="0")
    proc = subprocess.run([sys.executable, "-c", SESSION, str(run_dir)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(home.iterdir()) == []  # no ~/.ray/auth_token, nothing else either
    seen = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("SEEN "))[5:])
    assert seen["mode"] == "token" and len(seen["token"]) == 64
    assert seen["worker"][0] == seen["token"]  # the Ray processes got it by inheritance, not a file
    assert seen["worker"][1] == os.nice(0)  # the learner at the trainer's priority, not Ray's nice 15
    assert seen["token_after"] is None  # and it left the process's environment with the session
    # the folder holding Ray's, which Ray makes 0777 (world-writable, its sockets reachable by anyone) when a
    # worker of it starts: the task's did so after the session's set-up
    assert seen["ray_dir_mode"] == 0o700


def _agent(root: psutil.Process) -> psutil.Process | None:
    for p in root.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any("DashboardAgent" in a or "dashboard/agent.py" in a or "ray.dashboard.agent" in a
                   for a in p.cmdline()):
                return p
    return None


@pytest.mark.integration
def test_a_ray_start_that_times_out_is_ended_and_made_again(tmp_path):
    """Ray's raylet aborts when its dashboard agent has not reported its ports within ~15 s, as happens when a
    busy machine starts the agent slowly. Here the first start's agent is really held (SIGSTOP): the
    session ends that start's processes and starts Ray again, and the learner goes on."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "DRL_RAY_"))}
    env.update(HOME=str(tmp_path), PYTHONPATH=str(REPO))
    script = SESSION.replace('print("SEEN "', 'print("INSIDE", flush=True); sys.stdin.readline(); print("SEEN "')
    proc = subprocess.Popen([sys.executable, "-c", script, str(run_dir)], env=env, cwd=tmp_path, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        root, deadline, held = psutil.Process(proc.pid), time.monotonic() + 60, None
        while held is None and time.monotonic() < deadline and proc.poll() is None:
            held = _agent(root)
            time.sleep(0.02)
        assert held is not None, "no dashboard agent appeared"
        held.suspend()  # SIGSTOP: it never reports its ports
        assert proc.stdout.readline() == "INSIDE\n", proc.stderr.read()[-3000:]
        with contextlib.suppress(psutil.NoSuchProcess):
            assert held.status() == psutil.STATUS_ZOMBIE, "the failed start's agent still runs"
        out, err = proc.communicate("\n", timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert f"did not come up in time (attempt 1 of {_START_ATTEMPTS}" in err
    assert json.loads(out.split("SEEN ", 1)[1])["worker"][0] is None  # a Ray task ran in the new start
