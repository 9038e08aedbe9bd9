"""bench.lfm2_step runs its whole path (random LFM2-MoE saved as HF, loaded by the megatron backend, the
quickstart's learner step) on a tiny shape on the CPU, so the GPU call measures rather than debugs."""

from __future__ import annotations

import json

import pytest

from tests import megatron_cpu


@pytest.fixture(scope="module")
def dist():
    megatron_cpu.init_distributed()
    yield
    megatron_cpu.shutdown_distributed()


def test_lfm2_step_bench_runs_tiny_on_cpu(dist, tmp_path):
    from bench import lfm2_step

    out = tmp_path / "lfm2_step.json"
    assert lfm2_step.main(["--tiny", "--device", "cpu", "--steps", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    m = result["measured"]
    assert "error" not in m, m.get("traceback")
    assert m["layers"] == 4 and m["micro_batches"] >= 2 and m["step_s"] > 0
    assert 0 < m["active_params"] < m["params"]  # top-2 of 8 experts: a token passes through fewer weights
    # the real shapes, counted without building them: 8.34 B parameters, 1.56 B per token
    full = lfm2_step.lfm2_config(24)
    assert full.num_experts == 32 and full.num_experts_per_tok == 4
