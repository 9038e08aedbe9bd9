"""PNG plots of a run from its metrics JSONL (`.stoa/runs/<run>/metrics.jsonl`).

`plot_run` is called by the embedded run when it ends and by `invoke plot --run <id>`. It never fails on
partial data: a torn last line, a metric that is absent or never finite, or a run that stopped after one
step all just mean fewer plots. matplotlib draws with the Agg backend (no display needed).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PlotSpec:
    """One PNG: the metric keys it draws (first present wins per series) and how to label it."""

    filename: str
    title: str
    ylabel: str
    series: tuple[tuple[str, tuple[str, ...]], ...]  # (legend label, candidate keys)


#: the plots of a run; keys are those trainer/metrics.py documents (`*` matches one path segment), older
#: spellings kept as fallbacks so earlier runs still plot
PLOTS: tuple[PlotSpec, ...] = (
    PlotSpec("train_reward.png", "Train reward", "mean reward", (
        ("train reward", ("rollout/raw_reward", "train/reward", "reward")),
    )),
    PlotSpec("heldout_accuracy.png", "Held-out accuracy", "accuracy", (
        ("held-out", ("eval/accuracy", "heldout/accuracy", "eval/*/accuracy", "eval/*/reward_mean")),
    )),
    PlotSpec("staleness.png", "Staleness of consumed groups", "versions behind", (
        ("mean", ("rollout/staleness_mean",)),
        ("max", ("rollout/staleness_max",)),
    )),
    PlotSpec("gate_drop_fraction.png", "DPPO gate: dropped token fraction", "fraction of tokens", (
        ("gate drop", ("train/gate_drop_frac", "train/gate_drop_fraction")),
    )),
    PlotSpec("patch_size.png", "Published patch size", "bytes", (
        ("patch", ("publish/patch_bytes",)),
    )),
)

STEP_KEYS = ("step", "train/step", "version")


def _flatten(d: dict, prefix: str = "") -> Iterator[tuple[str, object]]:
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            yield from _flatten(v, key + "/")
        else:
            yield key, v


def read_metrics(path: str | Path) -> list[dict[str, object]]:
    """The JSONL's records, flattened to `a/b` keys; unreadable lines (a torn last write) are skipped."""
    rows = []
    try:
        text = Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return rows
    for line in text.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            rows.append(_derive(dict(_flatten(obj))))
    return rows


def _derive(row: dict[str, object]) -> dict[str, object]:
    """Add `rollout/staleness_max`: the largest lag with any group in `rollout/staleness_hist/<lag>`."""
    lags = [int(k.rsplit("/", 1)[1]) for k, v in row.items()
            if k.startswith("rollout/staleness_hist/") and k.rsplit("/", 1)[1].isdigit() and _finite(v)]
    if lags and "rollout/staleness_max" not in row:
        row["rollout/staleness_max"] = float(max(lags))
    return row


def _finite(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None


def _step(row: dict[str, object]) -> float | None:
    return next((s for k in STEP_KEYS if (s := _finite(row.get(k))) is not None), None)


def _expand(rows: list[dict[str, object]], candidates: tuple[str, ...]) -> list[str]:
    """Candidates in order, each `*` pattern replaced by the matching keys (sorted)."""
    out = []
    for c in candidates:
        if "*" not in c:
            out.append(c)
            continue
        rx = re.compile("^" + re.escape(c).replace(r"\*", "[^/]+") + "$")
        out += sorted({k for row in rows for k in row if rx.match(k)})
    return out


def series_for(rows: list[dict[str, object]], candidates: tuple[str, ...]) -> tuple[list[float], list[float]]:
    """(steps, values) of the first candidate key that has any finite value with a step."""
    for key in _expand(rows, candidates):
        xs, ys = [], []
        for row in rows:
            x, y = _step(row), _finite(row.get(key))
            if x is not None and y is not None:
                xs.append(x)
                ys.append(y)
        if xs:
            return xs, ys
    return [], []


def plot_run(metrics_jsonl: str | Path, out_dir: str | Path) -> list[Path]:
    """Write one PNG per plot whose metric is present; returns the paths written (maybe none)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_jsonl)
    out_dir = Path(out_dir)
    written: list[Path] = []
    for spec in PLOTS:
        drawn = [(label, *series_for(rows, keys)) for label, keys in spec.series]
        drawn = [d for d in drawn if d[1]]
        if not drawn:
            continue
        out_dir.mkdir(parents=True, exist_ok=True)
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
        try:
            for label, xs, ys in drawn:
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
            ax.set_title(spec.title)
            ax.set_xlabel("step")
            ax.set_ylabel(spec.ylabel)
            ax.grid(alpha=0.3)
            if len(drawn) > 1:
                ax.legend()
            fig.tight_layout()
            path = out_dir / spec.filename
            fig.savefig(path)
            written.append(path)
        finally:
            plt.close(fig)
    return written
