"""bench/worker_speed.py runs tiny on the CPU (each part writes its result file with the figures the docs
quote), and a bad option is refused in one sentence with exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx.core", reason="the bench runs the MLX worker too")
REPO = Path(__file__).resolve().parent.parent


def _bench(*args: str, out: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "bench.worker_speed", *args, *(["--out", str(out)] if out else [])]
    return subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=600)


def test_the_bench_runs_tiny(tmp_path):
    p = _bench("decode", "--groups", "1", "--n", "2", "--budget", "6", out=tmp_path / "d.json")
    assert p.returncode == 0, p.stderr[-2000:]
    d = json.loads((tmp_path / "d.json").read_text())
    for worker in ("torch", "mlx"):
        for mode in ("psqa_one_at_a_time", "psqa_together", "gsm8k_style_group"):
            assert d[worker][mode]["sampled_tokens"] > 0 and d[worker][mode]["forwards"] > 0
    assert d["mlx"]["mlx_lm_batch_generate"]["forwards"] > 0
    for worker in ("mlx", "torch"):
        p = _bench("swap", "--worker", worker, "--tiny", out=tmp_path / f"s_{worker}.json")
        assert p.returncode == 0, p.stderr[-2000:]
        s = json.loads((tmp_path / f"s_{worker}.json").read_text())
        assert 0 < s["scaled_to_8b_a1b"]["bytes"] < s["scaled_to_8b_a1b"]["plane_bytes"]
    p = _bench("start", "--tiny", "--runs", "1", out=tmp_path / "st.json")
    assert p.returncode == 0, p.stderr[-2000:]
    st = json.loads((tmp_path / "st.json").read_text())
    assert st["model"]["params"] > 0 and all(len(v) == 1 and v[0] > 0 for v in st["wall_s"].values()), st
    p = _bench("memory", "--tiny", "--n", "2", "--budget", "6", out=tmp_path / "m.json")
    assert p.returncode == 0, p.stderr[-2000:]
    m = json.loads((tmp_path / "m.json").read_text())["layer_scaled"]
    # the worker's own process: its peak grows from its imports through the join (each stage's, not the parent's)
    assert 0 < m["rss_peak_after_imports"] < m["rss_peak_after_join"] <= m["rss_peak_after_psqa_group"], m


@pytest.mark.parametrize("args,needle", [(["decode", "--n", "0"], "--n: 0 is out of range: give a number at least 1"),
                                         (["swap", "--worker", "cuda"], "invalid choice: 'cuda'"),
                                         (["speed"], "invalid choice: 'speed'")])
def test_a_bad_option_is_one_sentence_and_exit_2(args, needle):
    p = _bench(*args)
    assert p.returncode == 2 and needle in p.stderr.strip().splitlines()[-1] and "Traceback" not in p.stderr
