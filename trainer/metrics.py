"""Learner metrics: a JSONL file always; W&B and TensorBoard when asked; a stats object per version.

Names: `train/*` (loss, clip and gate fractions, ratio and KL statistics, grad norm), `rollout/*`
(raw_reward, staleness histogram, drops by reason), `worker/*` (groups and version lag per worker),
`publish/*` (bytes, latency). The JSONL file is `<run_dir>/metrics.jsonl`, one object per step.
More in docs/architecture.md (module notes).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from worker_contract import layout
from worker_contract.store import Store, StoreError

log = logging.getLogger(__name__)

STATS_FORMAT = 1


class OptionalDependencyError(ImportError):
    """An optional logger was asked for but its package is not installed."""


def _clean(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """JSON-safe values: non-finite floats become None (JSON has no NaN)."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, float) and not math.isfinite(v):
            v = None
        out[k] = v
    return out


def end_torn_line(path: str | Path) -> None:
    """Before a new writer appends to a JSONL file: end a last line a killed writer left without its newline,
    so the fragment stays one unreadable line (skipped by readers) instead of gluing itself to the next row."""
    try:
        with open(path, "rb+") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
    except FileNotFoundError:
        return


class MetricsLogger:
    """Writes every step's metrics to the JSONL file and to whichever optional sinks are enabled."""

    def __init__(self, run_dir: str | Path, run: str, *, config: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None):
        env = os.environ if env is None else env
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._tb = self._open_tensorboard() if env.get("DRL_TENSORBOARD", "") not in ("", "0") else None
        self._wandb = self._open_wandb(run, config, env) if env.get("DRL_WANDB_PROJECT") else None
        end_torn_line(self.path)  # an earlier session killed mid-line: its fragment must not swallow our first row
        self._file = open(self.path, "a", buffering=1)  # line-buffered: a crash loses at most one line

    def _open_wandb(self, run: str, config: Mapping[str, Any] | None, env: Mapping[str, str]):
        try:
            import wandb
        except ImportError:
            raise OptionalDependencyError(
                f"DRL_WANDB_PROJECT={env['DRL_WANDB_PROJECT']!r} asks for W&B logging, but wandb is not "
                "installed: `.venv/bin/pip install wandb` (or the `logging` extra; WANDB_MODE=offline logs without "
                "a network), "
                "or unset DRL_WANDB_PROJECT"
            ) from None
        return wandb.init(project=env["DRL_WANDB_PROJECT"], entity=env.get("DRL_WANDB_ENTITY") or None,
                          name=run, id=run, resume="allow", dir=str(self.run_dir),
                          config=dict(config or {}), mode=env.get("WANDB_MODE") or None)

    def _open_tensorboard(self):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise OptionalDependencyError(
                "DRL_TENSORBOARD=1 asks for TensorBoard logging, but tensorboard is not installed: "
                "`.venv/bin/pip install tensorboard` (or the `logging` extra), or unset DRL_TENSORBOARD"
            ) from None
        return SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        row = {"step": step, "time": time.time(), **_clean(metrics)}
        self._file.write(json.dumps(row, sort_keys=True) + "\n")
        numeric = {k: float(v) for k, v in metrics.items()
                   if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, global_step=step)

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    """Every row of a run's metrics.jsonl (a torn last line from a crash is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def version_stats(
    *,
    version: int,
    step: int,
    kind: str,
    metrics: Mapping[str, Any],
    drops_total: Mapping[str, int],
    drops_delta: Mapping[str, int],
    workers: Mapping[str, Mapping[str, Any]],
    groups: int,
    publish: Mapping[str, Any],
) -> dict[str, Any]:
    """The stats object of one published version (the operator's view, read by `invoke status`)."""
    return {
        "format": STATS_FORMAT,
        "version": version,
        "step": step,
        "kind": kind,
        "groups": groups,
        "drops": {k: int(v) for k, v in drops_delta.items() if v},
        "drops_total": {k: int(v) for k, v in drops_total.items() if v},
        "workers": {w: dict(s) for w, s in workers.items()},
        "publish": _clean(publish),
        # per-worker values are under "workers"; the step's publish/* values describe the previous
        # version, so this object carries its own version's under "publish" instead
        "metrics": _clean({k: v for k, v in metrics.items() if not k.startswith(("worker/", "publish/"))}),
        "written_at": time.time(),
    }


def write_version_stats(store: Store, run: str, stats: Mapping[str, Any]) -> bool:
    """Put the stats object at stats/v<version>.json; a failure is logged, never raised (stats are advisory)."""
    try:
        store.put(layout.stats_key(run, int(stats["version"])), json.dumps(stats, sort_keys=True).encode())
        return True
    except (StoreError, OSError) as e:
        log.warning("writing stats for version %s failed: %s", stats.get("version"), e)
        return False
