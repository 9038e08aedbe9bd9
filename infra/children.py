"""The records of the embedded launcher's child processes (embedded/localprocs.py writes them): which
recorded child still runs, read by the launcher on a relaunch and by `invoke stop|teardown --local`
(infra/boxops.py) after a launcher died without stopping its children."""

from __future__ import annotations

import json
import os
from pathlib import Path

#: the run dir's folder of child records, one `<name>.json` per live child of the launcher
CHILDREN_DIR = "children"


def process_start_time(pid: int) -> float | None:
    """When `pid` started (psutil's create_time, seconds), or None if it is gone or a zombie."""
    import psutil

    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc.create_time()
    except psutil.Error:
        return None


def group_members(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (a child's own group: it and what it started, Ray's too)."""
    import psutil

    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc.pid)
        except (OSError, psutil.Error):
            continue
    return members


def recorded_children(run_dir: Path) -> list[dict]:
    """The children recorded in `run_dir/children/` that still run: the recorded PID is still that process
    (same start time: a recycled PID is not), or its process group (which the kernel keeps from reuse while
    it has members) still has members, e.g. the learner's Ray processes after the learner ended. Each as
    {name, pid, started, record, leader_alive}. Meaningful only while no launcher holds the run's lock."""
    out = []
    for rec in sorted((Path(run_dir) / CHILDREN_DIR).glob("*.json")):
        try:
            child = json.loads(rec.read_text())
            pid, started = int(child["pid"]), child["started"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        now = process_start_time(pid)
        alive = started is not None and now == started
        if alive or (now is None and group_members(pid)):
            out.append({"name": str(child.get("name", rec.stem)), "pid": pid, "started": started,
                        "record": str(rec), "leader_alive": alive})
    return out
