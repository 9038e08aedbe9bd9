"""On-box process control for a run: start the trainer detached, report, stop, tear down.

Runs on the GPU box itself, directly or as `python3 -m infra.boxops status|stop|teardown --remote-dir D
--run R` over SSH (infra/remote), so both paths share one implementation. The trainer runs in a session
of its own (setsid) with its output in `<remote_dir>/logs/<run>.log` and `<pid> <start time>` in the run's
pid file, so it survives the SSH session that started it and a recycled PID is never mistaken for it.
`stop` ends only that process group and the run's Ray jobs, by PID. More in docs/operations.md (module
notes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path

from .children import CHILDREN_DIR, group_members, process_start_time, recorded_children

#: the Ray dashboard slime's jobs are submitted to (bound to localhost by infra.launch_gpu)
DASHBOARD = "http://127.0.0.1:8265"
RAY_MARKER = ".stoa/ray.started"


def _proc_start(pid: int) -> int | None:
    """Start time of `pid` in clock ticks (field 22 of /proc/<pid>/stat); None if gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def read_pid(pid_file: str | Path) -> tuple[int, int] | None:
    try:
        pid, start = Path(pid_file).read_text().split()
        return int(pid), int(start)
    except (OSError, ValueError):
        return None


def alive_pid(pid_file: str | Path) -> int | None:
    """The trainer's PID if the process recorded in `pid_file` is still that process and running."""
    rec = read_pid(pid_file)
    if rec is None:
        return None
    pid, start = rec
    return pid if _proc_start(pid) == start else None


def start_detached(argv: Sequence[str], *, log_file: str | Path, pid_file: str | Path,
                   env: Mapping[str, str] | None = None, cwd: str | Path | None = None) -> int:
    """Start `argv` in a new session, output appended to `log_file`; record it in `pid_file`."""
    log_file, pid_file = Path(log_file), Path(pid_file)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as log:
        log.write(f"=== stoa launch {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(argv[:6])} ...\n".encode())
        log.flush()
        proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, close_fds=True, cwd=cwd,
                                env=dict(os.environ if env is None else env))
    start = None
    for _ in range(100):  # /proc appears with the process; wait for it briefly
        start = _proc_start(proc.pid)
        if start is not None or proc.poll() is not None:
            break
        time.sleep(0.01)
    tmp = pid_file.with_suffix(".tmp")
    tmp.write_text(f"{proc.pid} {start if start is not None else -1}\n")
    tmp.replace(pid_file)
    return proc.pid


def tail(path: str | Path, lines: int) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip("\n") for line in deque(f, maxlen=lines)]
    except OSError:
        return []


def gpu_usage() -> dict:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"ok": False, "error": "nvidia-smi not found (no NVIDIA driver)"}
    out = subprocess.run([smi, "--query-gpu=index,name,utilization.gpu,memory.used,memory.total",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return {"ok": False, "error": out.stderr.strip() or out.stdout.strip()}
    gpus = []
    for line in out.stdout.strip().splitlines():
        i, name, util, used, total = (x.strip() for x in line.split(","))
        gpus.append({"index": int(i), "name": name, "util_pct": float(util), "mem_used_mib": float(used),
                     "mem_total_mib": float(total)})
    return {"ok": True, "gpus": gpus}


def status(remote_dir: str, run: str, lines: int = 20) -> dict:
    """Read-only: is the run's trainer alive, its last log lines, GPU use."""
    from .slime_launch import BoxPaths

    paths = BoxPaths(remote_dir=remote_dir, run=run)
    pid = alive_pid(paths.pid_file)
    rec = read_pid(paths.pid_file)
    return {
        "run": run, "remote_dir": remote_dir, "deployed": True,
        "alive": pid is not None, "pid": pid if pid is not None else (rec[0] if rec else None),
        "log_file": paths.log_file, "log_tail": tail(paths.log_file, lines), "gpu": gpu_usage(),
    }


def _ray_jobs(run: str) -> tuple[list, str | None, bool]:
    """([(client, job)] of `run`'s running jobs, a note, whether Ray's jobs are known): no dashboard
    listening means no Ray job here (known); a dashboard that answers but cannot list them leaves them unknown."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(DASHBOARD)
    try:  # nothing listens: no Ray here, and no need to import it
        socket.create_connection((url.hostname, url.port), timeout=1).close()
    except OSError:
        return [], f"no Ray dashboard at {DASHBOARD}: no Ray job to stop", True
    try:
        from ray.job_submission import JobStatus, JobSubmissionClient

        client = JobSubmissionClient(DASHBOARD)
        jobs = [j for j in client.list_jobs() if (j.metadata or {}).get("stoa_run") == run
                and j.status in (JobStatus.PENDING, JobStatus.RUNNING)]
        return [(client, j) for j in jobs], None, True
    except Exception as e:  # something listens there but does not list Ray's jobs: they are unknown
        return [], (f"Ray's jobs could not be listed at {DASHBOARD} ({type(e).__name__}): any of run {run} "
                    "are not stopped"), False


def stop(remote_dir: str, run: str, *, timeout_s: float = 30.0, dry_run: bool = False, log=print) -> dict:
    """Stop the run's Ray jobs and its detached trainer process group (SIGTERM, then SIGKILL); a run started in a
    terminal here (`make gsm8k`, holding the run's lock) is stopped as Ctrl-C would stop it there."""
    from .slime_launch import BoxPaths

    paths = BoxPaths(remote_dir=remote_dir, run=run)
    launcher = _live_launcher(Path(remote_dir).resolve(), run)
    if launcher == -1:  # held by a process that did not write itself down: nothing known to signal
        raise ValueError(_live_run_refusal(paths, "stop"))
    if launcher is not None:
        out = {"run": run, "launcher": launcher, "ray_jobs": [], "pid": None, "leftovers": [], "stopped": False}
        if dry_run:
            log(f"would stop the launcher of run {run} (pid {launcher}) as Ctrl-C would [dry run]")
            return out
        out["stopped"] = stop_launcher(launcher, paths.state_dir, timeout_s=max(timeout_s, LAUNCHER_STOP_S),
                                            log=log)
        return out
    jobs, note, listed = _ray_jobs(run)
    pid = alive_pid(paths.pid_file)
    leftovers = leftover_children(paths.state_dir)
    out = {"run": run, "ray_jobs": [j.submission_id for _, j in jobs], "ray_jobs_listed": listed, "pid": pid,
           "leftovers": [_named(c) for c in leftovers], "stopped": False}
    if note:
        log(note)
    if dry_run:
        if listed and not (jobs or pid or leftovers):
            log(f"nothing of run {run} is running here: nothing to stop [dry run]")
        else:
            log(f"would stop Ray jobs {out['ray_jobs'] or 'none'} and process group {pid or 'none'}"
                + (f", and {_describe(leftovers)} left by a launcher that is gone" if leftovers else "") + " [dry run]")
        return out
    if (Path(paths.state_dir) / CHILDREN_DIR).is_dir():  # also the records of children gone by themselves
        out["leftovers"] = [_named(c) for c in stop_leftovers(paths.state_dir, timeout_s=timeout_s, log=log)]
    for client, job in jobs:
        log(f"stopping Ray job {job.submission_id}")
        client.stop_job(job.submission_id)
    if pid is not None:
        if os.getpgid(pid) != pid:  # started by start_detached, so it leads its own group
            raise RuntimeError(f"pid {pid} does not lead its process group; refusing to signal the group")
        # the leader first: the native learner finishes its step, checkpoints and shuts its own Ray down;
        # a SIGTERM to the whole group would reach its Ray processes first, which die on it mid-step
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while alive_pid(paths.pid_file) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        if alive_pid(paths.pid_file) is not None:
            log(f"trainer {pid} ignored SIGTERM for {timeout_s:.0f} s; sending SIGKILL")
            os.killpg(pid, signal.SIGKILL)
        else:
            try:  # whatever of its group outlived it
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        log(f"stopped trainer process group {pid}")
    elif not out["leftovers"]:
        log(f"no trainer process of run {run} is running")
    Path(paths.pid_file).unlink(missing_ok=True)
    out["stopped"] = True
    return out


#: written by ship_tree in a tree it shipped (infra/remote/deploy.py): the mark of a box's copy, whose
#: credentials file teardown may delete; a checkout of your own never has it
SHIPPED_MARK = ".stoa-tree.sha256"


#: the lock a running `make gsm8k RUN=<run>` holds on its run dir (embedded/run.py takes it with `lock_run_dir`)
RUN_LOCK = ".lock"
#: seconds `stop` waits for a launcher it stopped: its children's graceful stop (embedded/localprocs.py, 60 s)
#: and its last evaluation and summary
LAUNCHER_STOP_S = 120.0


def lock_run_dir(state_dir: str | Path, *, create: bool = False, launcher: bool = False):
    """An exclusive flock on the run dir's lock file, held while the returned file stays open (the lock
    `make gsm8k` takes), or None when a live process holds it. Without the file (and `create`, or without
    the run dir) nothing can hold it: a stand-in with nothing to release."""
    import fcntl

    path = Path(state_dir) / RUN_LOCK
    if not path.exists() and not (create and Path(state_dir).is_dir()):
        return _NoLock()
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    if launcher:  # the launcher writes itself down, for `stop` to end (lock_holder); a probe, stop or teardown
        # that takes the lock for a moment does not, so a record names a launcher or no live process
        f.truncate(0)  # "a+" writes at the end, now 0
        f.write(json.dumps({"pid": os.getpid(), "start": _proc_start(os.getpid()), "created": _created(os.getpid())}))
        f.flush()
    return f


def lock_holder(state_dir: str | Path) -> int | None:
    """The PID of the process holding the run dir's lock, as it wrote itself down (lock_run_dir), if that
    process still runs (its start time checked, so a recycled PID is never taken for it); else None."""
    try:
        held = json.loads((Path(state_dir) / RUN_LOCK).read_text())
        pid, start, created = int(held["pid"]), held.get("start"), held.get("created")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # none, or one written before holders were
        return None
    if start is not None:  # Linux: the start in clock ticks, exact
        return pid if _proc_start(pid) == start else None
    now = _created(pid)  # macOS (no /proc): psutil's creation time
    return pid if created is not None and now is not None and abs(now - created) < 0.01 else None


def _created(pid: int) -> float | None:
    """psutil's creation time of `pid` where psutil is there (the launcher's venv; not make clean's Python)."""
    try:
        return process_start_time(pid)
    except ImportError:
        return None


class _NoLock:
    """Nothing to hold: the run dir has no lock file (no process of the run ever locked it)."""

    def close(self) -> None:
        pass


def run_is_live(state_dir: str | Path) -> bool:
    """Whether a process of the run holds its run dir's lock right now."""
    lock = lock_run_dir(state_dir)
    if lock is None:
        return True
    lock.close()
    return False


def leftover_children(state_dir: str | Path) -> list[dict]:
    """The embedded launcher's children still running after it died without stopping them (SIGKILL; a child
    that outlived its SIGTERM; macOS): infra.children.recorded_children, read only with the run's lock
    free (a live launcher stops its own children)."""
    if not (Path(state_dir) / CHILDREN_DIR).is_dir() or run_is_live(state_dir):
        return []
    return recorded_children(Path(state_dir))


def _named(child: dict) -> dict:
    """What stop's answer says of a leftover child (its JSON, also read back over SSH)."""
    return {k: child[k] for k in ("name", "pid", "leader_alive")}


def _describe(children: list[dict]) -> str:
    return ", ".join(f"{c['name']} (pid {c['pid']})" if c["leader_alive"] else f"{c['name']}'s process group "
                     f"{c['pid']}" for c in children)


def leftovers_action(run: str, children: list[dict]) -> str:
    """The plan's line for the children a dead launcher of `run` left running (stop and teardown alike)."""
    return f"stop what the launcher of run {run} left running when it died: {_describe(children)}"


def stop_leftovers(state_dir: str | Path, *, timeout_s: float = 30.0, log=print) -> list[dict]:
    """With the run's lock held: SIGTERM each leftover child (the learner checkpoints, a worker finishes its
    group), SIGKILL what is left of its process group after `timeout_s`, and delete the run's child records
    (also those of children gone by themselves). The children stopped; none while a launcher holds the lock."""
    lock = lock_run_dir(state_dir)
    if lock is None:  # a launcher runs (again): its children are its own
        return []
    try:
        children = recorded_children(Path(state_dir))
        for c in children:
            if c["leader_alive"]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(c["pid"], signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(
                process_start_time(c["pid"]) == c["started"] for c in children if c["leader_alive"]):
            time.sleep(0.1)
        for c in children:
            if group_members(c["pid"]):  # each child leads its own session (localprocs): this is its group
                log(f"SIGKILL to what is left of {c['name']}'s process group {c['pid']}")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c["pid"], signal.SIGKILL)
            log(f"stopped {c['name']} (pid {c['pid']}), left running by a launcher of the run that is gone")
        for rec in (Path(state_dir) / CHILDREN_DIR).glob("*.json"):
            rec.unlink(missing_ok=True)
    finally:
        lock.close()
    return children


def _other_live_runs(root: Path, run: str) -> list[str]:
    """Other runs of this tree whose trainer is alive (their Ray and credentials must stay)."""
    runs_dir = root / ".stoa" / "runs"
    if not runs_dir.is_dir():
        return []
    return sorted(d.name for d in runs_dir.iterdir()
                  if d.name != run and (alive_pid(d / "trainer.pid") is not None or run_is_live(d)))


def live_runs(root: str | Path) -> list[str]:
    """Every run of this tree that a process holds right now (its lock, or its detached trainer alive):
    `make clean STATE=1` deletes nothing while one does."""
    return _other_live_runs(Path(root), "")


def _live_launcher(root: Path, run: str) -> int | None:
    """The PID of a process other than the detached trainer holding the run's lock (a `make gsm8k` in a
    terminal), or None when no such process holds it."""
    from .slime_launch import BoxPaths

    paths = BoxPaths(remote_dir=str(root), run=run)
    if alive_pid(paths.pid_file) is not None or not run_is_live(paths.state_dir):
        return None
    return lock_holder(paths.state_dir) or -1


def _refuse_live_run(root: Path, run: str, what: str) -> None:
    """A run whose lock is held by a process that is not the detached trainer (a `make gsm8k` in a
    terminal): refuse, so its key, metrics and checkpoints are never deleted under it."""
    from .slime_launch import BoxPaths

    if _live_launcher(root, run) is not None:
        raise ValueError(_live_run_refusal(BoxPaths(remote_dir=str(root), run=run), what))


def _live_run_refusal(paths, what: str) -> str:
    """The sentence that refuses `what` while a process other than the detached trainer holds the run's lock."""
    run = paths.run
    how = "Ctrl-C where it runs" if what == "stop" else f"invoke stop --run {run} --local, or Ctrl-C where it runs"
    return (f"run {run} is running on this machine (another process holds {paths.state_dir}/{RUN_LOCK}, e.g. "
            f"make gsm8k RUN={run}); {what} refused: stop it first ({how}) and try again")


def stop_launcher(pid: int, state_dir: str | Path, *, timeout_s: float, log=print) -> bool:
    """What Ctrl-C in its terminal does: SIGTERM to the launcher holding the run's lock, which it takes as a clean
    stop (its learner checkpoints, its workers finish their group) and says so in its summary there; True once it
    let go of the lock. Not SIGINT: a launcher started in the background of a script ignores that one."""
    log(f"stopping the launcher of the run (pid {pid}) as Ctrl-C would; it stops its learner and workers")
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:  # it ended between the look and the signal
        return True
    deadline = time.monotonic() + timeout_s
    started = _proc_start(pid)

    def stopping() -> bool:  # the lock goes first, then the launcher itself (its summary printed); on Linux, both
        return run_is_live(state_dir) or (started is not None and _proc_start(pid) == started)

    while stopping() and time.monotonic() < deadline:
        time.sleep(0.2)
    if stopping():
        log(f"the launcher (pid {pid}) is still stopping after {timeout_s:.0f} s; its terminal shows how far it got")
        return False
    log(f"the launcher of the run (pid {pid}) has ended; its terminal (or log) has its summary")
    return True


def _run_paths(root: Path, run: str) -> list[Path]:
    """The run's own files and directories in the tree: its state dir and its log (both named by run id)."""
    from .slime_launch import BoxPaths

    paths = BoxPaths(remote_dir=str(root), run=run)
    own = [Path(paths.state_dir), Path(paths.log_file)]
    for p in own:  # a run id is one path segment, so these are inside the tree; a symlink out is refused
        if p.is_symlink() or not p.resolve().is_relative_to(root):
            raise ValueError(f"{p} is a link out of {root}; teardown deletes only the run's own files")
    return own


def teardown_actions(remote_dir: str, run: str, *, purge: bool = False) -> list[str]:
    """Exactly what `teardown` will do, one line each (the dry run and the confirmation print them)."""
    from worker_contract.layout import check_run_id

    check_run_id(run)
    root = Path(remote_dir).resolve()
    if not root.is_dir():
        raise ValueError(f"--remote-dir {remote_dir} is not a directory on this machine")
    _refuse_live_run(root, run, "teardown")
    others = _other_live_runs(root, run)
    actions = [f"stop the trainer of run {run} (its Ray jobs and its process group)"]
    from .slime_launch import BoxPaths

    leftovers = leftover_children(BoxPaths(remote_dir=str(root), run=run).state_dir)
    if leftovers:
        actions.append(leftovers_action(run, leftovers))
    if (root / RAY_MARKER).exists() and not others:
        actions.append("ray stop (this tree started Ray for its runs)")
    creds = root / ".r2env"
    if creds.exists():
        if others:
            actions.append(f"keep {creds}: runs {', '.join(others)} are still running here")
        elif (root / SHIPPED_MARK).exists() and not (root / ".git").exists():
            actions.append(f"delete {creds} (the credentials shipped to this box)")
        else:
            actions.append(f"keep {creds}: this tree was not shipped by a launch (it is your own checkout)")
    if purge:
        for p in _run_paths(root, run):
            if p.exists():
                actions.append(f"delete {p}{'/' if p.is_dir() else ''}{_what_goes(p)}")
    return actions


def _what_goes(path: Path) -> str:
    """What a purged run dir holds that cannot be made again, said in the plan before anything goes."""
    if not path.is_dir():
        return ""
    named = (("trainer.key", "trainer.key, the run's signing key: without it the run can never resume or publish "
              "again"), ("checkpoints", "its checkpoints"), ("metrics.jsonl", "its metrics"))
    held = [what for name, what in named if (path / name).exists()]
    return f" ({'; '.join(held)})" if held else ""


def teardown(remote_dir: str, run: str, *, purge: bool = False, dry_run: bool = False, log=print) -> dict:
    """Stop the run (and the Ray we started, when no other run of the tree is alive), delete the shipped
    credentials; `purge` also deletes the run's own files. Never the tree itself, a checkout or another run."""
    root = Path(remote_dir).resolve()
    actions = teardown_actions(remote_dir, run, purge=purge)
    if dry_run:
        for a in actions:
            log(f"would {a} [dry run]")
        return {"run": run, "actions": actions, "dry_run": True}
    stop(remote_dir, run, log=log)
    from .slime_launch import BoxPaths

    lock = lock_run_dir(BoxPaths(remote_dir=str(root), run=run).state_dir, create=True)  # held while deleting
    if lock is None:  # started since the plan was made
        _refuse_live_run(root, run, "teardown")
        raise ValueError(f"run {run} started again while tearing down; teardown stopped before deleting anything")
    try:
        _teardown_stopped(root, run, actions, purge, log)
    finally:
        lock.close()
    return {"run": run, "actions": actions, "dry_run": False}


def _teardown_stopped(root: Path, run: str, actions: list[str], purge: bool, log) -> None:
    """The deleting half of teardown, with the run stopped and its lock held by us."""
    if any(a.startswith("ray stop") for a in actions) and shutil.which("ray"):
        subprocess.run(["ray", "stop"], check=False)
        (root / RAY_MARKER).unlink(missing_ok=True)
    if any(a.startswith(f"delete {root / '.r2env'}") for a in actions):
        (root / ".r2env").unlink(missing_ok=True)
        log(f"deleted {root / '.r2env'}")
    if purge:
        for p in _run_paths(root, run):
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
            else:
                continue
            log(f"deleted {p}")


def main(argv: list[str] | None = None) -> int:
    from worker_contract.cli import number

    ap = argparse.ArgumentParser(prog="python -m infra.boxops", description="on-box control of a stoa run (the "
                                 "box side of invoke logs/stop/teardown, which list and confirm first)")
    ap.add_argument("command", choices=["status", "stop", "teardown"])
    ap.add_argument("--remote-dir", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--lines", type=number(int, at_least=1), default=20)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--purge", action="store_true")
    ap.add_argument("--yes", action="store_true", help="confirmed: stop/teardown change nothing without it")
    args = ap.parse_args(argv)
    from worker_contract.layout import check_run_id

    check_run_id(args.run)
    if not Path(args.remote_dir).is_dir():
        raise ValueError(f"--remote-dir {args.remote_dir} is not a directory on this machine")
    if args.command != "status" and not (args.dry_run or args.yes):
        raise ValueError(f"{args.command} changes the box: pass --dry-run to list what it would do, --yes to do it")
    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731 - stdout carries the JSON answer only
    if args.command == "status":
        out = status(args.remote_dir, args.run, args.lines)
    elif args.command == "stop":
        out = stop(args.remote_dir, args.run, dry_run=args.dry_run, log=log)
    else:
        out = teardown(args.remote_dir, args.run, purge=args.purge, dry_run=args.dry_run, log=log)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    from worker_contract.cli import run_main

    sys.exit(run_main(main, "python -m infra.boxops"))
