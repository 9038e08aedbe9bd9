"""The fleet recipe's engine in a loop that learns, tiny on the CPU: bench.psqa_gpu --tiny builds a small
LFM2-MoE base (sigmoid router with expert bias, top-2 of 4 experts) supervised into the search format, then
runs the embedded psqa loop on it twice, same base and seed: on the native learner's megatron backend (gloo,
bf16 compute, float32 masters, bf16 Adam moments) and on the hf backend. Every process is real: the retriever,
a torch worker sampling multi-turn episodes from the int8g64 plane with paged_prefix, the learner process and
its publisher; each run's versions verify and reconstruct.

megatron-core has no CPU path: RotaryEmbedding.get_emb calls torch.cuda.current_device() on every forward.
DRL_MEGATRON_CPU_SETUP names tests.megatron_cpu:setup_rank, which answers that call in the learner's ranks;
everything else runs as on the GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_embedded_e2e import _leftovers, _verify


def _rows(root: Path, run: str) -> list[dict]:
    path = root / "runs" / run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_megatron_and_hf_run_the_psqa_loop_on_the_same_base(tmp_path, monkeypatch):
    from bench import psqa_gpu
    from worker_contract.manifest import load_manifest
    from worker_contract.reconstruct import Reconstructor
    from worker_contract.store import open_store

    monkeypatch.setenv("DRL_MEGATRON_CPU_SETUP", "tests.megatron_cpu:setup_rank")
    root, out = tmp_path / "root", tmp_path / "psqa.json"
    rc = psqa_gpu.main(["--tiny", "--device", "cpu", "--backends", "megatron,hf", "--max-steps", "3",
                        "--rl-seconds", "900", "--root", str(root), "--run", "pair", "--out", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0, json.dumps(result["runs"], indent=1)[:3000]
    mg, hf = result["recipes"]["megatron"], result["recipes"]["hf"]
    assert mg["train"]["backend"] == "megatron" and hf["train"]["backend"] == "hf"
    assert (mg["train"]["compute_dtype"], mg["algo"]["optim"]["moment_dtype"]) == ("bfloat16", "bfloat16")
    assert mg["model"]["path"] == hf["model"]["path"] and mg["train"]["seed"] == hf["train"]["seed"]
    assert mg["contract"] == hf["contract"] == {"n_samples": 8, "plane": "int8g64", "kv_mode": "paged_prefix"}
    base = json.loads((Path(mg["model"]["path"]) / "config.json").read_text())
    assert base["model_type"] == "lfm2_moe" and base["num_experts"] >= 4 and base["num_experts_per_tok"] > 1
    assert base.get("use_expert_bias", True)  # the fleet model's router: sigmoid scores with expert bias
    store = open_store(f"file://{root}/bucket")
    for backend in ("megatron", "hf"):
        run = f"pair-{backend}"
        steps = [r for r in _rows(root, run) if "rollout/raw_reward" in r]
        assert [r["step"] for r in steps] == [1, 2, 3], backend
        assert all("rollout/search_rate" in r for r in steps)  # multi-turn search episodes
        assert result["runs"][backend]["evals"], backend  # held-out cover-EM of published versions
        published = max(r["version"] for r in steps)
        rec = Reconstructor(store, run, plane="int8g64", public_key=load_manifest(store, run).trainer_public_key)
        rec.join()
        rec.follow()
        assert rec.version >= published, backend  # the newest version, reconstructed from its anchor and patches
        v = _verify(root, run)
        assert v.returncode == 0, v.stdout + v.stderr
    assert result["paired"]["backends"] == ["megatron", "hf"] and result["paired"]["curves"]
    log = (root / "runs" / "pair-megatron" / "learner.log").read_text()
    assert "megatron" in log.lower() or "MasterAdamW" in log or "step 3" in log
    assert _leftovers(tmp_path) == []
