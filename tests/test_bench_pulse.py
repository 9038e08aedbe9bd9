"""The benchmarks run: the GPU one on a tiny shape with --device cpu, the CPU one on a tiny model."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
REPO = Path(__file__).resolve().parents[1]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("plane", ["bf16", "int8g64"])
def test_pulse_gpu_bench_runs_on_cpu_tiny(tmp_path, plane):
    """The GPU bench's path (the publisher with the torch encoder) on CPU tensors of the tiny shape."""
    out = tmp_path / "pulse_gpu.json"
    res = _run(["bench.pulse_gpu", "--device", "cpu", "--shape", "tiny", "--plane", plane, "--hash-threads", "2",
                "--out", str(out)])
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    assert data["exact"] is True and data["shape"] == "tiny" and data["plane"] == plane and 0.9 < data["sparsity"] < 1
    assert data["encoder"] == "torch" and data["gpu"] is None and data["hash_threads"] == 2
    assert data["machine"]["commit"] and data["encode_s"] >= data["plane_s"] >= 0 and data["patch_bytes"] > 0
    # what tests/test_bench_results.py asks of every result file (the tree here may be dirty: said, not hidden)
    assert re.fullmatch(r"[0-9a-f]{40}", data["commit"]) and isinstance(data["clean"], bool)
    assert data["command"] == ("python -m bench.pulse_gpu --device cpu --shape tiny --plane " + plane
                               + " --hash-threads 2 --out " + str(out))


def test_pulse_gpu_bench_refuses_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    res = _run(["bench.pulse_gpu", "--shape", "tiny"])
    assert res.returncode == 2 and "no CUDA device" in res.stderr


def test_pulse_cpu_bench_runs_on_a_tiny_model(tmp_path):
    out = tmp_path / "pulse.json"
    res = _run(["bench.pulse_bench", "--steps", "1", "--layers", "1", "--hidden", "256", "--vocab", "1024",
                "--out", str(out)])
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    assert data["command"].startswith("python -m bench.pulse_bench --steps 1 ") and data["machine"]["cpu"]
    for scen in data["scenarios"].values():
        for plane in ("bf16", "int8g64"):
            s = scen["planes"][plane]["summary"]
            assert s["all_exact"] and 0 < s["sparsity"] < 1
