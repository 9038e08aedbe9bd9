"""`plot_run`: one PNG per metric present, and nothing breaks on partial or damaged metrics."""

from __future__ import annotations

import json
import math

from infra.ops.plots import PLOTS, plot_run, read_metrics, series_for

PNG = b"\x89PNG\r\n\x1a\n"


def _full_rows(n=6):
    """What the learner logs per step (names from trainer/metrics.py), plus a held-out eval every 2 steps."""
    rows = []
    for s in range(1, n + 1):
        row = {"rollout/raw_reward": 0.1 * s, "rollout/staleness_mean": 1.5, "rollout/staleness_hist/0": 3.0,
               "rollout/staleness_hist/1": 4.0, "rollout/staleness_hist/2": 1.0 if s % 2 else 0.0,
               "train/gate_drop_frac": 0.01 * s, "publish/patch_bytes": 1000 + s, "train/loss": float("nan")}
        if s % 2 == 0:
            row["eval/accuracy"] = 0.3 + 0.02 * s
        rows.append((s, row))
    return rows


def _write(path, rows, tail=""):
    path.write_text("".join(json.dumps({"step": s, **r}) + "\n" for s, r in rows) + tail)
    return path


def test_every_plot_written_from_the_learners_own_metrics_file(tmp_path):
    from trainer.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path / "run", "plot-run", env={})
    for step, row in _full_rows():
        logger.log(step, row)
    logger.close()
    paths = plot_run(logger.path, tmp_path / "plots")
    assert sorted(p.name for p in paths) == sorted(s.filename for s in PLOTS)
    for p in paths:
        data = p.read_bytes()
        assert data.startswith(PNG) and len(data) > 5000
    rows = read_metrics(logger.path)
    assert series_for(rows, ("rollout/staleness_max",)) == ([1, 2, 3, 4, 5, 6], [2, 1, 2, 1, 2, 1])
    assert series_for(rows, ("eval/accuracy",))[0] == [2, 4, 6]


def test_partial_data_gives_fewer_plots_never_a_crash(tmp_path):
    key = "rollout/raw_reward"
    rows = [{"step": 1, key: 0.2}, {"step": 2, key: float("nan")},
            {"step": 3, key: 0.4, "eval/accuracy": None}, {"no_step": True, key: 9},
            [1, 2, 3], {"step": 4, key: "high"}]
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + '\n{"step": 5, "rollout/raw')
    paths = plot_run(path, tmp_path / "plots")
    assert [p.name for p in paths] == ["train_reward.png"]
    xs, ys = series_for(read_metrics(path), (key,))
    assert xs == [1, 3] and ys == [0.2, 0.4]
    assert all(math.isfinite(y) for y in ys)


def test_nested_metrics_are_flattened(tmp_path):
    rows = [(s, {"publish": {"patch_bytes": 10 * s}}) for s in range(1, 4)]
    paths = plot_run(_write(tmp_path / "m.jsonl", rows), tmp_path / "out")
    assert [p.name for p in paths] == ["patch_size.png"]


def test_missing_or_empty_metrics_write_nothing(tmp_path):
    assert plot_run(tmp_path / "absent.jsonl", tmp_path / "plots") == []
    assert plot_run(_write(tmp_path / "empty.jsonl", []), tmp_path / "plots") == []
    assert not (tmp_path / "plots").exists()


def test_single_step_run_still_plots(tmp_path):
    paths = plot_run(_write(tmp_path / "m.jsonl", _full_rows(2)[1:]), tmp_path / "plots")  # only step 2
    assert len(paths) == len(PLOTS)


def test_slime_eval_names_are_found_by_pattern(tmp_path):
    rows = [{"step": s, "eval/psqa_test/reward_mean": 0.1 * s} for s in range(1, 4)]
    paths = plot_run(_write(tmp_path / "m.jsonl", [(r.pop("step"), r) for r in rows]), tmp_path / "plots")
    assert [p.name for p in paths] == ["heldout_accuracy.png"]


def test_invoke_plot_task(tmp_path):
    import shutil
    import subprocess
    import sys
    import uuid
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    run = f"plot-task-{uuid.uuid4().hex[:8]}"
    run_dir = repo / ".stoa" / "runs" / run  # where the embedded run keeps metrics.jsonl
    run_dir.mkdir(parents=True)
    try:
        _write(run_dir / "metrics.jsonl", _full_rows(4))
        out = subprocess.run([sys.executable, "-m", "invoke", "plot", "--run", run, "--out", str(tmp_path / "p")],
                             cwd=repo, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert sorted(Path(p).name for p in out.stdout.split()) == sorted(s.filename for s in PLOTS)
        missing = subprocess.run([sys.executable, "-m", "invoke", "plot", "--run", run + "-absent"], cwd=repo,
                                 capture_output=True, text=True, timeout=120)
        assert missing.returncode == 2 and "does not exist" in missing.stderr
    finally:
        shutil.rmtree(run_dir)
