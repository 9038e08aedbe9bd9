"""Operate a run on its GPU box over SSH: status, logs, stop, teardown.

Each runs `python3 -m infra.boxops <cmd>` inside the shipped tree, so over SSH and on the box itself the
same code acts. Without a host (None) the command runs here, on the box.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import PurePosixPath

from .ssh import RemoteStepError, connect, q, run


def _boxops(conn, step: str, remote_dir: str, run_id: str, *args: str, python: str = "python3") -> dict:
    cmd = (f"cd {q(remote_dir)} && {q(python)} -m infra.boxops {step} --remote-dir {q(remote_dir)} "
           f"--run {q(run_id)} " + " ".join(q(a) for a in args))
    res = run(conn, step, cmd)
    if res.stderr.strip():
        print(res.stderr.rstrip(), file=sys.stderr)
    return json.loads(res.stdout.strip().splitlines()[-1])


def _local(step: str, remote_dir: str, run_id: str, *args: str) -> dict:
    res = subprocess.run([sys.executable, "-m", "infra.boxops", step, "--remote-dir", remote_dir, "--run", run_id,
                          *args], capture_output=True, text=True, check=False, cwd=remote_dir)
    if res.returncode != 0:
        raise RemoteStepError(step, "python -m infra.boxops", res.returncode, res.stderr, res.stdout)
    if res.stderr.strip():
        print(res.stderr.rstrip(), file=sys.stderr)
    return json.loads(res.stdout.strip().splitlines()[-1])


def _call(host: str | None, step: str, remote_dir: str, run_id: str, *args: str, ssh_key: str | None = None,
          python: str = "python3") -> dict:
    if host is None:
        return _local(step, remote_dir, run_id, *args)
    with connect(host, ssh_key) as conn:
        return _boxops(conn, step, remote_dir, run_id, *args, python=python)


def remote_status(host: str | None, run: str, *, ssh_key: str | None = None, remote_dir: str = "/root/dRL",
                  lines: int = 20, python: str = "python3") -> dict:
    """Read-only: trainer alive (pid), last log lines, GPU use. `deployed` is False if the tree is absent."""
    try:
        return _call(host, "status", remote_dir, run, "--lines", str(lines), ssh_key=ssh_key, python=python)
    except RemoteStepError as e:
        return {"run": run, "remote_dir": remote_dir, "deployed": False, "alive": False, "pid": None,
                "error": e.stderr or e.stdout}


def stop(host: str | None, run: str, *, ssh_key: str | None = None, remote_dir: str = "/root/dRL",
         dry_run: bool = False, python: str = "python3") -> dict:
    """Stop the run's trainer (its Ray jobs and its process group, by PID)."""
    return _call(host, "stop", remote_dir, run, *(["--dry-run"] if dry_run else []), ssh_key=ssh_key, python=python)


def teardown(host: str | None, run: str, *, ssh_key: str | None = None, remote_dir: str = "/root/dRL",
             purge: bool = False, dry_run: bool = False, python: str = "python3") -> dict:
    """Stop the run and Ray, delete the box's credentials; `purge` deletes the remote dir too."""
    extra = (["--purge"] if purge else []) + (["--dry-run"] if dry_run else [])
    return _call(host, "teardown", remote_dir, run, *extra, ssh_key=ssh_key, python=python)


def logs(host: str | None, run: str, *, ssh_key: str | None = None, remote_dir: str = "/root/dRL",
         lines: int = 100, follow: bool = False) -> int:
    """Print the last `lines` of the run's log; `follow` keeps printing until interrupted."""
    log_file = str(PurePosixPath(remote_dir) / "logs" / f"{run}.log")
    cmd = ["tail", "-n", str(lines), *(["-F"] if follow else []), log_file]
    if host is None:
        return subprocess.run(cmd, check=False).returncode
    with connect(host, ssh_key) as conn:
        res = conn.run(" ".join(q(c) for c in cmd), warn=True, pty=follow, in_stream=False)
        if res.exited != 0 and not follow:
            raise RemoteStepError("logs", " ".join(cmd), res.exited, res.stderr, res.stdout)
        return res.exited
