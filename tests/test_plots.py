"""`plot_run`: one PNG per metric present, and nothing breaks on partial or damaged metrics."""

from __future__ import annotations

import json
import math

from trainer.plots import PLOTS, plot_run, read_metrics, series_for

PNG = b"\x89PNG\r\n\x1a\n"


def _full_rows(n=6):
    return [{"step": s, "train/reward": 0.1 * s, "eval/accuracy": 0.3 + 0.02 * s,
             "rollout/staleness_mean": 1.5, "rollout/staleness_max": 3,
             "train/gate_drop_fraction": 0.01 * s, "publish/patch_bytes": 1000 + s} for s in range(1, n + 1)]


def _write(path, rows, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return path


def test_every_plot_written_when_every_metric_is_present(tmp_path):
    paths = plot_run(_write(tmp_path / "m.jsonl", _full_rows()), tmp_path / "plots")
    assert sorted(p.name for p in paths) == sorted(s.filename for s in PLOTS)
    for p in paths:
        data = p.read_bytes()
        assert data.startswith(PNG) and len(data) > 5000


def test_partial_data_gives_fewer_plots_never_a_crash(tmp_path):
    rows = [{"step": 1, "train/reward": 0.2}, {"step": 2, "train/reward": float("nan")},
            {"step": 3, "train/reward": 0.4, "eval/accuracy": None}, {"no_step": True, "train/reward": 9},
            [1, 2, 3], {"step": 4, "train/reward": "high"}]
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + '\n{"step": 5, "train/rew')
    paths = plot_run(path, tmp_path / "plots")
    assert [p.name for p in paths] == ["train_reward.png"]
    xs, ys = series_for(read_metrics(path), ("train/reward",))
    assert xs == [1, 3] and ys == [0.2, 0.4]
    assert all(math.isfinite(y) for y in ys)


def test_nested_metrics_are_flattened(tmp_path):
    rows = [{"step": s, "publish": {"patch_bytes": 10 * s}} for s in range(1, 4)]
    paths = plot_run(_write(tmp_path / "m.jsonl", rows), tmp_path / "out")
    assert [p.name for p in paths] == ["patch_size.png"]


def test_missing_or_empty_metrics_write_nothing(tmp_path):
    assert plot_run(tmp_path / "absent.jsonl", tmp_path / "plots") == []
    assert plot_run(_write(tmp_path / "empty.jsonl", []), tmp_path / "plots") == []
    assert not (tmp_path / "plots").exists()


def test_single_step_run_still_plots(tmp_path):
    paths = plot_run(_write(tmp_path / "m.jsonl", _full_rows(1)), tmp_path / "plots")
    assert len(paths) == len(PLOTS)
