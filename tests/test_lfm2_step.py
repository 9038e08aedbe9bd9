"""bench.lfm2_step runs its whole path (the optimizer candidates, a random LFM2-MoE saved as HF and loaded by
the megatron backend under the psqa recipe's plan, its learner step, the grouped / loop / recompute
comparison) on a tiny shape on the CPU, so the GPU call measures rather than debugs."""

from __future__ import annotations

import json


def test_lfm2_step_bench_runs_tiny_on_cpu(dist, tmp_path):
    from bench import lfm2_step

    out = tmp_path / "lfm2_step.json"
    rc = lfm2_step.main(["--tiny", "--device", "cpu", "--steps", "1", "--out", str(out),
                         "--parts", "optim,step,profile,compare",
                         "--set", "optim.offload=0.5", "--set", "optim.moment_dtype=bfloat16"])
    result = json.loads(out.read_text())
    assert rc == 0, result.get("traceback")
    m, step = result["measured"], result["step"]
    assert m["layers"] == 4 and m["micro_batches"] >= 2 and step["step_s"] > 0 and step["optimizer_s"] > 0
    assert 0 < m["active_params"] < m["params"]  # top-2 of 8 experts: a token passes through fewer weights
    assert m["plan"]["optimizer"] == "MasterAdamW" and m["plan"]["host_gib"] > 0
    assert m["plan"]["moment_dtype"] == "torch.bfloat16"
    assert result["profile"]["top"] and (tmp_path / result["profile"]["table"]).read_text().strip()
    assert set(result["compare"]) == {"grouped", "loop", "grouped+recompute"}
    assert all("error" not in v for v in result["compare"].values()), result["compare"]
    assert all("error" not in v for v in result["optimizer_candidates"].values())
    assert result["optimizer_candidates"]["offload_agrees"]["weights_and_masters_equal"] is True
    assert result["command"].startswith("python -m bench.lfm2_step --tiny")
    # the real shapes, counted without building them: 8.34 B parameters, 1.56 B per token
    full = lfm2_step.lfm2_config(24)
    assert full.num_experts == 32 and full.num_experts_per_tok == 4
