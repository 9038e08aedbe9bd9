"""Trial counts and figures for the reliability tests (`nox -s soak`, and their CI-sized twins).

Each reliability test has a CI-sized variant in the default lane and a `soak`-marked long one. The soak
session sets DRL_SOAK_TRIALS (its trial count) and DRL_SOAK_RESULTS (bench/results/soak.json); every test
then adds what it measured under its own section, so docs/reliability.md can quote one file.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

TRIALS_ENV = "DRL_SOAK_TRIALS"
RESULTS_ENV = "DRL_SOAK_RESULTS"
COMMIT_ENV = "DRL_SOAK_COMMIT"
CLEAN_ENV = "DRL_SOAK_CLEAN"  # "1" or "0": whether the tree was clean when the session started
COMMAND_ENV = "DRL_SOAK_COMMAND"
REPO = Path(__file__).resolve().parent.parent


def soak_trials(default: int) -> int:
    """Trials for a soak test: DRL_SOAK_TRIALS when set (the soak session passes its count), else `default`."""
    raw = os.environ.get(TRIALS_ENV, "")
    if not raw:
        return default
    n = int(raw)
    if n < 1:
        raise ValueError(f"{TRIALS_ENV}={raw!r} must be a positive number of trials")
    return n


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def record(section: str, figures: dict[str, Any]) -> None:
    """Add a test's figures to the soak results file (only when the soak session asked for one)."""
    path = os.environ.get(RESULTS_ENV)
    if not path:
        return
    p = Path(path)
    data = json.loads(p.read_text()) if p.exists() else {}
    data.setdefault("format", 1)
    data.setdefault("started_at", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    from bench.common import machine_info, provenance

    data["commit"] = os.environ.get(COMMIT_ENV) or _commit()  # the session names the commit it started on
    clean = os.environ.get(CLEAN_ENV)
    data["clean"] = {"1": True, "0": False}.get(clean) if clean else provenance()["clean"]
    data["command"] = os.environ.get(COMMAND_ENV) or "python -m pytest -m soak"
    data["machine"] = {k: v for k, v in machine_info().items() if k not in ("commit", "clean")}
    data.setdefault("sections", {})[section] = {**figures, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                        time.gmtime())}
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(p)
