"""Operate a run on its GPU box over SSH: status, logs, stop, teardown.

Each runs `python3 -m infra.boxops <cmd>` inside the shipped tree, so over SSH and on the box itself the
same code acts. Without a host (None) the command runs here, on the box.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path, PurePosixPath

from .ssh import RemoteStepError, connect, q, run


class BoxUnreachable(ValueError):
    """No SSH session to the box as given (address, port, key): the user's input or the box, not our code."""


def _connect(host: str, ssh_key: str | None):
    try:
        conn = connect(host, ssh_key)
        conn.open()
    except Exception as e:  # paramiko's and the socket's errors alike: the box is not reachable as given
        raise BoxUnreachable(f"cannot connect to {host} over SSH ({type(e).__name__}: {e}); check HOST, "
                             "--ssh-key and that the box is up") from None
    return conn


def _boxops(conn, step: str, remote_dir: str, run_id: str, *args: str, python: str = "python3") -> dict:
    cmd = (f"cd {q(remote_dir)} && {q(python)} -m infra.boxops {step} --remote-dir {q(remote_dir)} "
           f"--run {q(run_id)} " + " ".join(q(a) for a in args))
    res = run(conn, step, cmd)
    if res.stderr.strip():
        print(res.stderr.rstrip(), file=sys.stderr)
    return json.loads(res.stdout.strip().splitlines()[-1])


def _local(step: str, remote_dir: str, run_id: str, *args: str) -> dict:
    if not Path(remote_dir).is_dir():
        raise ValueError(f"--remote-dir {remote_dir} is not a directory on this machine")
    res = subprocess.run([sys.executable, "-m", "infra.boxops", step, "--remote-dir", remote_dir, "--run", run_id,
                          *args], capture_output=True, text=True, check=False, cwd=remote_dir)
    if res.returncode != 0:
        raise RemoteStepError(step, "python -m infra.boxops", res.returncode, res.stderr, res.stdout)
    if res.stderr.strip():
        print(res.stderr.rstrip(), file=sys.stderr)
    return json.loads(res.stdout.strip().splitlines()[-1])


def _call(host: str | None, step: str, remote_dir: str, run_id: str, *args: str, ssh_key: str | None = None,
          python: str = "python3") -> dict:
    """Run `python -m infra.boxops step` here or on `host`. The box's own refusal (exit 2: a bad run id, a
    missing tree) comes back as a ValueError carrying its sentence; an unreachable box as one too."""
    try:
        if host is None:
            return _local(step, remote_dir, run_id, *args)
        with _connect(host, ssh_key) as conn:
            return _boxops(conn, step, remote_dir, run_id, *args, python=python)
    except RemoteStepError as e:
        if e.exited == 2 and e.stderr:
            said = e.stderr.splitlines()[-1].removeprefix("python -m infra.boxops: ")  # its sentence names the step
            raise ValueError(f"{step} on {host}: {said}" if host else said) from None
        raise


def remote_status(host: str | None, run: str, *, ssh_key: str | None = None, remote_dir: str = "/root/dRL",
                  lines: int = 20, python: str = "python3") -> dict:
    """Read-only: trainer alive (pid), last log lines, GPU use. `deployed` is False if the tree is absent."""
    try:
        return _call(host, "status", remote_dir, run, "--lines", str(lines), ssh_key=ssh_key, python=python)
    except RemoteStepError as e:
        return {"run": run, "remote_dir": remote_dir, "deployed": False, "alive": False, "pid": None,
                "error": e.stderr or e.stdout}
    except BoxUnreachable:
        raise  # the caller reports an unreachable box (status: a note)
    except (ValueError, OSError) as e:  # the box refused (no such tree here)
        return {"run": run, "remote_dir": remote_dir, "deployed": False, "alive": False, "pid": None,
                "error": str(e)}


def stop(host: str | None, run: str, *, ssh_key: str | None = None, remote_dir: str = "/root/dRL",
         dry_run: bool = False, python: str = "python3") -> dict:
    """Stop the run's trainer (its Ray jobs and its process group, by PID). The caller has confirmed
    (invoke stop asks first); the box side refuses without that (`--yes`)."""
    return _call(host, "stop", remote_dir, run, "--dry-run" if dry_run else "--yes", ssh_key=ssh_key, python=python)


def teardown(host: str | None, run: str, *, ssh_key: str | None = None, remote_dir: str = "/root/dRL",
             purge: bool = False, dry_run: bool = False, python: str = "python3") -> dict:
    """Stop the run and Ray, delete the box's shipped credentials; `purge` deletes the run's own files too
    (infra.boxops.teardown_actions lists exactly what)."""
    extra = (["--purge"] if purge else []) + (["--dry-run"] if dry_run else ["--yes"])
    return _call(host, "teardown", remote_dir, run, *extra, ssh_key=ssh_key, python=python)


class NoLogYet(ValueError):
    """The run has no log where `invoke logs` looks: it was never started there (or under another id)."""


def logs(host: str | None, run: str, *, ssh_key: str | None = None, remote_dir: str = "/root/dRL",
         lines: int = 100, follow: bool = False) -> int:
    """Print the last `lines` of the run's log; `follow` keeps printing until interrupted.

    The launch on a box logs to <remote_dir>/logs/<run>.log; on this machine the embedded run (`make gsm8k`
    with no HOST) logs its learner to .stoa/runs/<run>/learner.log, shown when the first is absent. No log
    at all is a NoLogYet naming where it looked and how the run is started, not tail's own error.
    """
    log_file = str(PurePosixPath(remote_dir) / "logs" / f"{run}.log")
    if host is None:
        embedded = Path(remote_dir) / ".stoa" / "runs" / run / "learner.log"
        found = next((f for f in (Path(log_file), embedded) if f.is_file()), None)
        if found is None:
            raise NoLogYet(f"run {run!r} has no log on this machine: neither {log_file} nor {embedded} exists; "
                           f"start the run with `make gsm8k RUN={run}` (or `make psqa RUN={run}`), or check "
                           "the run id and --remote-dir")
        return subprocess.run(["tail", "-n", str(lines), *(["-F"] if follow else []), str(found)],
                              check=False).returncode
    cmd = ["tail", "-n", str(lines), *(["-F"] if follow else []), log_file]
    with _connect(host, ssh_key) as conn:
        res = conn.run(f"test -f {q(log_file)} || exit 66; " + " ".join(q(c) for c in cmd), warn=True,
                       pty=follow, in_stream=False)
        if res.exited == 66:
            raise NoLogYet(f"run {run!r} has no log on {host}: {log_file} does not exist; start the run with "
                           f"`make gsm8k RUN={run} HOST={host}` (or `make psqa ...`), or check the run id and "
                           "--remote-dir")
        if res.exited != 0 and not follow:
            raise RemoteStepError("logs", " ".join(cmd), res.exited, res.stderr, res.stdout)
        return res.exited
