"""`invoke teardown --local` after the embedded launcher died (SIGKILL) without stopping its children.

The launcher is a real process that takes the run's lock and starts its children through
embedded.localprocs.Processes, as `make gsm8k` does; its children stand in for a learner and a worker that
are still finishing their work when the launcher's death reaches them (the first SIGTERM asks for a clean
stop, which takes them a while; a second ends them), the learner with a process of its own group (as its
Ray processes are). Teardown must refuse while the launcher lives; then a new launch of the run is refused,
and teardown finds exactly those processes from the run's records, names them and stops them by PID (a
process it did not record stays, a record of a recycled PID is not signalled).
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
INVOKE = str(Path(sys.executable).with_name("invoke"))

#: a child finishing its work: the first SIGTERM starts a long clean stop, a second ends it at once
CHILD = ("import os, signal, subprocess, sys, time\n"
         "n = [0]\n"
         "def term(*_):\n"
         "    n[0] += 1\n"
         "    if n[0] > 1: sys.exit(0)\n"
         "signal.signal(signal.SIGTERM, term)\n"
         "if sys.argv[1] == 'learner':\n"
         "    g = subprocess.Popen(['sleep', '300'])\n"  # its own group's member, as Ray's processes are
         "    print('grandchild', g.pid, flush=True)\n"
         "print('up', flush=True)\n"
         "deadline = time.monotonic() + 300\n"
         "while time.monotonic() < deadline: time.sleep(0.1)\n")

LAUNCHER = ("import sys, time\n"
            "from pathlib import Path\n"
            "from embedded.run import EmbeddedPaths\n"
            "from infra.boxops import lock_run_dir\n"
            "from embedded.localprocs import Processes\n"
            "paths = EmbeddedPaths(Path(sys.argv[1]), sys.argv[2])\n"
            "paths.run_dir.mkdir(parents=True)\n"
            "lock = lock_run_dir(paths.run_dir, create=True, launcher=True)\n"
            "procs = Processes(record=paths.run_dir)\n"
            "for name in ('learner', 'worker-1'):\n"
            "    c = procs.start(name, [sys.executable, '-c', sys.argv[3], name], {}, paths.run_dir / f'{name}.log')\n"
            "    print(name, c.proc.pid, flush=True)\n"
            "time.sleep(300)\n")


def process_start_time(pid: int) -> float | None:
    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc.create_time()
    except psutil.Error:
        return None


def _invoke(*argv: str, root: Path, run: str) -> subprocess.CompletedProcess:
    return subprocess.run([INVOKE, *argv, "--run", run, "--local", "--remote-dir", str(root)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def _wait_for(path: Path, text: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in (got := path.read_text()):
            return got
        time.sleep(0.1)
    raise AssertionError(f"{path} never said {text!r}")


def test_teardown_stops_the_children_a_killed_launcher_left(tmp_path):
    run = "orphans-1"
    state = tmp_path / ".stoa" / "runs" / run
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path / ".stoa"), run, CHILD], cwd=REPO,
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    bystander = subprocess.Popen(["sleep", "300"])  # not the run's: teardown must leave it
    pids: dict[str, int] = {}
    try:
        for _ in range(2):
            name, pid = launcher.stdout.readline().split()
            pids[name] = int(pid)
        pids["grandchild"] = int(_wait_for(state / "learner.log", "up").split()[1])
        _wait_for(state / "worker-1.log", "up")

        live = _invoke("teardown", "--yes", root=tmp_path, run=run)  # the launcher holds the lock
        assert live.returncode == 2 and f"run {run} is running on this machine" in live.stderr, live.stderr

        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        time.sleep(1.0)  # the launcher's death reached the children (PDEATHSIG): they are finishing
        assert all(process_start_time(p) is not None for p in pids.values()), "a child ended by itself"

        # a record whose PID now belongs to another process (recycled): never named, never signalled
        (state / "children").mkdir(exist_ok=True)
        (state / "children" / "worker-9.json").write_text(json.dumps(
            {"name": "worker-9", "pid": bystander.pid, "started": process_start_time(bystander.pid) - 5.0}))

        from rich.console import Console

        from embedded.config import resolve_embedded
        from embedded.run import run_embedded

        buf = io.StringIO()
        # (a model that is not there: were the launch not refused, it would stop at the model, not train)
        cfg = resolve_embedded("gsm8k", env={}, overrides={"run": run, "model.path": str(tmp_path / "no-model")})
        assert run_embedded(cfg, console=Console(file=buf, width=300), root=tmp_path / ".stoa") == 2
        assert f"learner (pid {pids['learner']})" in buf.getvalue(), buf.getvalue()
        assert "worker-9" not in buf.getvalue() and not (tmp_path / ".stoa" / "bucket").exists()

        dry = _invoke("teardown", "--dry-run", root=tmp_path, run=run)
        assert dry.returncode == 0, dry.stderr
        for name in ("learner", "worker-1"):
            assert f"{name} (pid {pids[name]})" in dry.stdout, dry.stdout
        assert "worker-9" not in dry.stdout
        stop_dry = _invoke("stop", "--dry-run", root=tmp_path, run=run)
        assert stop_dry.returncode == 0 and f"learner (pid {pids['learner']})" in stop_dry.stderr, stop_dry.stderr
        assert {c["name"]: c["pid"] for c in json.loads(stop_dry.stdout)["leftovers"]} == {
            n: pids[n] for n in ("learner", "worker-1")}
        assert all(process_start_time(p) is not None for p in pids.values())  # a dry run stops nothing

        out = _invoke("teardown", "--yes", root=tmp_path, run=run)
        assert out.returncode == 0, out.stderr
        assert "Traceback" not in out.stderr
        for name in ("learner", "worker-1"):
            assert f"stopped {name}" in out.stderr and str(pids[name]) in out.stderr, out.stderr
        deadline = time.monotonic() + 10
        while any(process_start_time(p) for p in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [n for n, p in pids.items() if process_start_time(p) is not None] == []
        assert bystander.poll() is None
        assert not list((state / "children").glob("*.json"))  # the records went with them
    finally:
        for pid in pids.values():  # the test started them (through its launcher); end them by PID
            if process_start_time(pid) is not None:
                os.kill(pid, signal.SIGKILL)
        for proc in (launcher, bystander):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
