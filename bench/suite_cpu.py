"""Where a command's CPU goes, process by process: `make test` on the 2-core CI box is bound by CPU, not waits.

    python -m bench.suite_cpu [--out bench/results/suite_cpu.json] [--log FILE] -- make test

The command runs under Linux process accounting (`accton`, from the acct package; root), which records every
process that ends with its CPU time, the short ones a poller would miss included. A poller notes each
process's command line and parent every 0.25 s to name it; one that ended before it was seen takes its
parent's name. The result: the command's wall time and exit status, the machine's busy and idle
core-seconds, the CPU-seconds of the processes it started grouped by what they are (GROUPS), and the
costliest command lines. Accounting is machine-wide, so only one such run at a time (STOA_SUITE_CPU).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

from .common import write_result

#: (group, pattern over the command line), first match wins
GROUPS = (
    ("ray: workers (the learner's actors)", r"default_worker\.py|ray::"),
    ("ray: its own processes", r"gcs_server|/raylet|dashboard|log_monitor|/monitor\.py|runtime_env|ray/_private"),
    ("the recipe's base, built from scratch", r"from embedded\.basemodel import ensure_base"),
    ("pytest's workers (tests in-process)", r"import sys;exec\(eval\(sys\.stdin\.readline"),
    ("rollout workers", r"-m worker_contract\.worker|-m bench\.coin_task"),
    ("learners", r"-m entrypoints\.learner|learner_proc\.py"),
    ("set-up (venv, install, bytecode)", r"bootstrap\.py|uv pip|pip install|compileall|/uv "),
    ("benches the tests run", r"-m bench\."),
    ("make, nox, invoke, fab", r"^make|/nox |/invoke |/fab "),
    ("our other CLIs", r"-m (entrypoints|infra|worker_contract)\b"),
    ("ssh, sshd, git, apt-get", r"sshd|^ssh |/ssh |^git |/git |apt-get|dpkg"),
    ("pytest (controller)", r"-m pytest\b"),
)
POLL_S = 0.25


def _poll(stop: threading.Event, seen: dict[int, tuple[int, str]], busy: list[float]) -> None:
    """Every process's (parent, command line) the first time it is seen; the machine's busy/idle core-seconds."""
    import psutil

    first = psutil.cpu_times()
    while not stop.is_set():
        for p in psutil.process_iter(["pid", "ppid", "cmdline"]):
            if p.info["pid"] not in seen and p.info["cmdline"]:
                seen[p.info["pid"]] = (p.info["ppid"], " ".join(p.info["cmdline"]))
        stop.wait(POLL_S)
    last = psutil.cpu_times()
    busy[:] = [sum(getattr(last, f) - getattr(first, f) for f in ("user", "system", "nice", "irq", "softirq")),
               (last.idle - first.idle) + (last.iowait - first.iowait)]


def _accounted(pacct: Path) -> dict[int, tuple[int, float]]:
    """pid -> (parent at exit, CPU seconds) of every process the accounting file recorded (`dump-acct`)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = subprocess.run(["dump-acct", str(pacct)], capture_output=True, text=True, check=True).stdout
    procs = {}
    for line in out.splitlines():
        f = [x.strip() for x in line.split("|")]
        procs[int(f[9])] = (int(f[10]), (float(f[2]) + float(f[3])) / tick)
    return procs


def _name(cmdline: str) -> str:
    return next((group for group, pattern in GROUPS if re.search(pattern, cmdline)), "other")


def _short(cmdline: str) -> str:
    """A command line with its temporary paths and numbers folded, so repeats of one command add up."""
    return re.sub(r"\d+", "N", re.sub(r"/tmp/\S+", "/tmp/…", cmdline))[:160]


def breakdown(root: int, procs: dict[int, tuple[int, float]], seen: dict[int, tuple[int, str]]) -> dict:
    """CPU-seconds of `root`'s descendants by group and by command line."""
    def parent(pid: int) -> int | None:
        return seen[pid][0] if pid in seen else procs[pid][0] if pid in procs else None

    def line(pid: int) -> str | None:  # its own command line, or its nearest named ancestor's
        for _ in range(64):
            if pid in seen:
                return seen[pid][1]
            pid = parent(pid)
            if pid is None:
                return None
        return None

    def descends(pid: int) -> bool:
        for _ in range(64):
            pid = parent(pid)
            if pid is None or pid <= 1:
                return False
            if pid == root:
                return True
        return False

    groups: dict[str, list] = defaultdict(lambda: [0.0, 0])
    lines: dict[str, list] = defaultdict(lambda: [0.0, 0])
    others: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for pid, (_, cpu) in procs.items():
        if pid != root and not descends(pid):
            continue
        cmdline = line(pid) or "(unnamed)"
        group, short = _name(cmdline), _short(cmdline)
        for table, key in ((groups, group), (lines, short), *([(others, short)] if group == "other" else [])):
            table[key][0] += cpu
            table[key][1] += 1
    total = sum(cpu for cpu, _ in groups.values())

    def rows(table: dict, n: int | None = None) -> list[dict]:
        ranked = sorted(table.items(), key=lambda kv: -kv[1][0])[:n]
        return [{"name": k, "cpu_s": round(cpu, 1), "share": round(cpu / total, 3) if total else 0.0,
                 "processes": count} for k, (cpu, count) in ranked]

    return {"cpu_s": round(total, 1), "groups": rows(groups), "top_commands": rows(lines, 30),
            "top_other_commands": rows(others, 15)}


def _accounting_tools() -> str | None:
    """Why process accounting cannot run here, or None (the acct package is installed when we are root)."""
    if os.environ.get("STOA_SUITE_CPU"):
        return "a bench.suite_cpu run is already accounting on this machine (STOA_SUITE_CPU is set)"
    if os.geteuid() != 0:
        return "process accounting needs root (accton)"
    if shutil.which("accton") is None and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "acct"],
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, capture_output=True)
    if shutil.which("accton") is None or shutil.which("dump-acct") is None:
        return "accton and dump-acct are missing (apt-get install acct)"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.suite_cpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="result JSON (default bench/results/suite_cpu.json)")
    ap.add_argument("--log", default=None, help="the command's output (default: this process's own)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command, e.g. -- make test")
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("give the command to measure after --, e.g. python -m bench.suite_cpu -- make test")
    if shutil.which(cmd[0]) is None:
        ap.error(f"{cmd[0]!r} is not a command here (give a program on PATH or a path to one)")
    if args.log and not Path(args.log).resolve().parent.is_dir():
        ap.error(f"--log {args.log}: its folder does not exist")
    why = _accounting_tools()
    if why:
        print(f"bench.suite_cpu: {why}", file=sys.stderr)
        return 2
    seen: dict[int, tuple[int, str]] = {}
    busy: list[float] = []
    stop = threading.Event()
    poller = threading.Thread(target=_poll, args=(stop, seen, busy), daemon=True)
    with tempfile.TemporaryDirectory(prefix="stoa-acct-") as tmp:
        pacct = Path(tmp) / "pacct"
        pacct.touch()
        on = subprocess.run(["accton", str(pacct)], capture_output=True, text=True)
        if on.returncode != 0:  # a container without CAP_SYS_PACCT
            print(f"bench.suite_cpu: process accounting is not permitted here: {on.stderr.strip()}", file=sys.stderr)
            return 2
        try:
            poller.start()
            t0 = time.monotonic()
            with open(args.log, "wb") if args.log else open(os.devnull, "wb") as log:
                out = log if args.log else None
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None,
                                        env={**os.environ, "STOA_SUITE_CPU": "1"})
                seen[proc.pid] = (os.getpid(), " ".join(cmd))
                rc = proc.wait()
            wall = time.monotonic() - t0
            time.sleep(2 * POLL_S)  # what ended last is in the file
        finally:
            subprocess.run(["accton", "off"], capture_output=True)
            stop.set()
            poller.join()
        result = breakdown(proc.pid, _accounted(pacct), seen)
    result = {"measured_command": cmd, "rc": rc, "wall_s": round(wall, 1),
              "machine_busy_core_s": round(busy[0], 1), "machine_idle_core_s": round(busy[1], 1), **result}
    path = write_result("suite_cpu", result, args.out, argv=argv, module="bench.suite_cpu")
    print(f"{' '.join(cmd)}: exit {rc}, {wall:.0f} s wall, {result['cpu_s']:.0f} CPU-s in its processes")
    for g in result["groups"]:
        print(f"  {g['cpu_s']:8.1f} CPU-s {g['share']:6.1%} {g['processes']:6d} processes  {g['name']}")
    print(f"wrote {path}")
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
