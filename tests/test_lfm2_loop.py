"""bench.lfm2_loop runs its whole path tiny on the CPU, so the GPU call measures rather than debugs: a random
LFM2-MoE of the fleet model's architecture, the psqa recipe's megatron learner (gloo, tests.megatron_cpu's hook
for megatron-core's CUDA call), a coin-task worker, the follower reconstructing every version bit-exact, a cold
join, checkpoints written off the step, and the learner killed (SIGKILL) and resumed at the next version."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_lfm2_loop_bench_runs_tiny_on_cpu(tmp_path, monkeypatch):
    from bench import lfm2_loop

    monkeypatch.setenv("DRL_MEGATRON_CPU_SETUP", "tests.megatron_cpu:setup_rank")
    # the values the bench's main sets by default, here through monkeypatch: the next test in this process
    # gets its environment back as it was
    monkeypatch.setenv("DRL_MIN_FREE_GB", "20")
    monkeypatch.setenv("DRL_RAY_DASHBOARD", "0")
    out = tmp_path / "lfm2_loop.json"
    # each window ends at the learner's 8th step (checkpoints, an anchor and patches past the base), not after a
    # fixed 45 s of the learner, the worker and the follower running (about 30 steps on an idle core)
    rc = lfm2_loop.main(["--tiny", "--device", "cpu", "--steps", "8", "--seconds", "300", "--workers", "1",
                         "--worker-device", "cpu", "--planes", "int8g64,bf16", "--root", str(tmp_path / "root"),
                         "--out", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0, json.dumps({p: result[p].get("error") or result[p].get("learner_log_tail", "")[-1500:]
                                for p in ("int8g64", "bf16")}, indent=1)
    assert result["model"]["layers"] == 4 and 0 < result["model"]["active_params"] < result["model"]["params"]
    for plane in ("int8g64", "bf16"):
        r = result[plane]
        assert r["recipe"]["train"]["backend"] == "megatron" and r["recipe"]["contract"]["plane"] == plane
        assert r["steps"] >= 2 and r["steps_per_hour_measured"] and r["busy_share_fed"] is not None
        assert r["patch_bytes_median"] and r["patch_bytes_p90"] >= r["patch_bytes_median"]
        assert r["anchor_bytes"] and 0 <= r["unchanged_share_median"] <= 1
        assert r["publish_blocking_s_median"] is not None and r["publish_encode_s_median"] is not None
        assert r["follower"]["error"] is None and r["follower"]["versions_reconstructed_bit_exact"] >= 1
        ck = r["checkpoints"]
        assert ck["written"] >= 1 and all(b > 0 for b in ck["bytes"]) and ck["disk_need_gb_by_formula"] > 0
        # the preflight's box.disk formula: float32 masters and two bf16 moments, 8 bytes a parameter
        assert ck["bytes_per_param"] == pytest.approx(ck["bytes_per_param_by_formula"], rel=0.1), ck
    first = result["int8g64"]
    cold = first["cold_join"]
    assert cold["seconds"] > 0 and cold["anchor_bytes"] > 0 and cold["download_s_100mbit"] >= cold["download_s_1gbit"]
    kr = first["kill_and_resume"]
    assert kr["continues_from_checkpoint"] and kr["continues_at_next_version"], kr
