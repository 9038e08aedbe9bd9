"""The staleness sweep's statistics, table and figure (bench/staleness.py runs the cells).

Per (objective, lag): the mean of the last evaluation with its 95% Student-t interval over seeds, the same for
the mean of the last three evaluations and the gain over each cell's own base, and the paired difference to
the same objective's lag-0 cell of the same seed (same prompts, same worker seed) with its 95% interval; the
fraction of tokens PPO's clip range holds back (clip low/high, dual) and the gate drops, per cell, averaged.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

#: two-sided 95% Student-t quantiles by degrees of freedom (df > 30: the normal 1.96 is within 2%)
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 25: 2.060, 30: 2.042}


def t975(df: int) -> float:
    if df < 1:
        return math.inf
    return _T975.get(df) or (_T975[max(k for k in _T975 if k <= df)] if df <= 30 else 1.96)


def interval(values: list[float]) -> dict:
    """mean, sample std, n and the 95% t-interval [lo, hi] of the mean (lo = hi = mean when n = 1: no interval)."""
    n = len(values)
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if n > 1 else 0.0
    half = t975(n - 1) * std / math.sqrt(n) if n > 1 else 0.0
    return {"mean": mean, "std": std, "n": n, "ci95": [mean - half, mean + half] if n > 1 else None}


def last3(curve: list[list[float]]) -> float:
    """Mean held-out accuracy of the last three evaluations after the start (fewer when the run has fewer)."""
    after = [acc for step, acc in curve if step > 0][-3:]
    return statistics.fmean(after)


def cell_fractions(per_step: list[dict], objective: str) -> dict:
    """Mean over steps of the share of tokens each mechanism acts on: `clipped` = PPO's clip range (low when
    A < 0, high when A > 0, plus the dual clip for the recipe), `gated` = the DPPO gate. For no_is (which
    applies neither) `clipped` says what PPO would have clipped on the same tokens."""
    def mean(key):
        vals = [s.get(key, 0.0) for s in per_step]
        return statistics.fmean(vals) if vals else 0.0
    clipped = mean("clip_low_frac") + mean("clip_high_frac") + (mean("clip_dual_frac") if objective == "recipe" else 0.0)
    gated = mean("gate_drop_frac") if objective == "recipe" else 0.0
    return {"clipped_frac": clipped, "gated_frac": gated}


def summarize(cells: list[dict]) -> dict:
    """{objective: {lag: row}}; row: final (last evaluation), last3, gain (final - base), best, the paired
    difference of final and last3 to lag 0, clipped and gated fractions, and the seeds it holds."""
    out: dict[str, dict[str, dict]] = {}
    by = {(c["objective"], c["lag"], c["seed"]): c for c in cells}
    for (obj, lag) in sorted({(c["objective"], c["lag"]) for c in cells}, key=lambda t: t[1]):
        mine = sorted((c for c in cells if c["objective"] == obj and c["lag"] == lag), key=lambda c: c["seed"])
        fr = [cell_fractions(c["per_step"], obj) for c in mine]
        row = {
            "seeds": [c["seed"] for c in mine],
            "final": interval([c["final_accuracy"] for c in mine]),
            "last3": interval([last3(c["curve"]) for c in mine]),
            "best": interval([max(a for _, a in c["curve"]) for c in mine]),
            "gain": interval([c["final_accuracy"] - c["base_accuracy"] for c in mine]),
            "clipped_frac": statistics.fmean(f["clipped_frac"] for f in fr),
            "gated_frac": statistics.fmean(f["gated_frac"] for f in fr),
            "ratio_max": max(c["ratio_max"] for c in mine),
        }
        pairs = [(c, by.get((obj, 0, c["seed"]))) for c in mine]
        pairs = [(c, z) for c, z in pairs if z is not None]
        if lag != 0 and pairs:
            row["vs_lag0"] = interval([c["final_accuracy"] - z["final_accuracy"] for c, z in pairs])
            row["vs_lag0_last3"] = interval([last3(c["curve"]) - last3(z["curve"]) for c, z in pairs])
        out.setdefault(obj, {})[str(lag)] = row
    return out


def _pts(x: float) -> str:
    return f"{100 * x:+.1f}"


def fmt_ci(iv: dict | None, signed: bool = False) -> str:
    """'47.3 [45.1, 49.5]' in points (signed for differences); '-' for none."""
    if not iv:
        return "-"
    f = _pts if signed else (lambda x: f"{100 * x:.1f}")
    return f"{f(iv['mean'])} [{f(iv['ci95'][0])}, {f(iv['ci95'][1])}]" if iv["ci95"] else f"{f(iv['mean'])} (n 1)"


def table(summary: dict, order: tuple[str, ...]) -> str:
    """A markdown table: per objective and lag, the final accuracy, the paired difference to lag 0 and the
    clipped / gated token fractions."""
    lags = sorted({int(k) for rows in summary.values() for k in rows})
    lines = ["| objective | k | final % [95% CI] | last 3 % [95% CI] | final - lag 0 (paired) | "
             "last 3 - lag 0 (paired) | clipped % | gated % | n |", "|---|---|---|---|---|---|---|---|---|"]
    for obj in (o for o in order if o in summary):
        for k in lags:
            row = summary[obj].get(str(k))
            if row:
                lines.append(f"| {obj} | {k} | {fmt_ci(row['final'])} | {fmt_ci(row['last3'])} | "
                             f"{fmt_ci(row.get('vs_lag0'), True)} | {fmt_ci(row.get('vs_lag0_last3'), True)} | "
                             f"{100 * row['clipped_frac']:.2f} | {100 * row['gated_frac']:.2f} | {row['final']['n']} |")
    return "\n".join(lines)


def _err(iv: dict) -> tuple[float, float]:
    lo, hi = iv["ci95"] or (iv["mean"], iv["mean"])
    return 100 * (iv["mean"] - lo), 100 * (hi - iv["mean"])


def plot(summary: dict, cells: list[dict], path: Path, title: str, order: tuple[str, ...]) -> Path:
    """Two panels against forced lag: the last evaluation (mean, 95% CI; dots = seeds; the base dashed), and
    the paired difference to lag 0 (mean, 95% CI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lags = sorted({int(k) for rows in summary.values() for k in rows})
    pos = {k: i for i, k in enumerate(lags)}
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    objs = [o for o in order if o in summary]
    for j, obj in enumerate(objs):
        rows, dx = summary[obj], (j - (len(objs) - 1) / 2) * 0.1
        ks = sorted(int(k) for k in rows)
        xs = [pos[k] + dx for k in ks]
        means = [100 * rows[str(k)]["final"]["mean"] for k in ks]
        err = list(zip(*(_err(rows[str(k)]["final"]) for k in ks), strict=True))
        line = ax.errorbar(xs, means, yerr=err, marker="o", capsize=3, label=obj)
        dots = [(pos[c["lag"]] + dx, 100 * c["final_accuracy"]) for c in cells if c["objective"] == obj]
        ax.scatter(*zip(*dots, strict=True), s=8, alpha=0.4, color=line[0].get_color())
        dk = [k for k in ks if "vs_lag0" in rows[str(k)]]
        d = [rows[str(k)]["vs_lag0"] for k in dk]
        if d:
            bx.errorbar([pos[k] + dx for k in dk], [100 * r["mean"] for r in d], marker="o", capsize=3,
                        yerr=list(zip(*(_err(r) for r in d), strict=True)),
                        label=obj, color=line[0].get_color())
    base = statistics.fmean(c["base_accuracy"] for c in cells)
    ax.axhline(100 * base, ls="--", lw=1, color="grey", label="base")
    bx.axhline(0, lw=1, color="grey")
    for a, ylabel in ((ax, "held-out accuracy, last evaluation (%)"), (bx, "paired difference to k = 0 (points)")):
        a.set_xticks(range(len(lags)), [str(k) for k in lags])
        a.set_xlabel("forced staleness k (versions behind the learner)")
        a.set_ylabel(ylabel)
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
