"""The fleet recipe's engine in a loop, tiny on the CPU: bench.psqa_gpu --tiny runs the embedded psqa loop on a
small LFM2-MoE (sigmoid router with expert bias, top-2 of 4 experts; on the GPU the bench supervises a larger
one into the search format first) twice, same base and seed: on the native learner's megatron backend (gloo,
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
    from episode_fixtures import save_search_model

    from bench import psqa_gpu
    from worker_contract.manifest import load_manifest
    from worker_contract.reconstruct import Reconstructor
    from worker_contract.store import open_store

    monkeypatch.setenv("DRL_MEGATRON_CPU_SETUP", "tests.megatron_cpu:setup_rank")
    root, out = tmp_path / "root", tmp_path / "psqa.json"
    # a random LFM2-MoE whose vocabulary holds the search tags, biased to search: multi-turn episodes from the
    # first step; the base build's own tests are test_psqa_base's. Unbiased (seed 2: 12 of 48 episodes of 48
    # tokens searched on psqa prompts here), CI once saw a backend's 3 steps train on no search; biased, 31 of 48,
    # and 5 to 11 of each step's 16 in this loop
    model = save_search_model(tmp_path / "model", "lfm2_moe", seed=2, search_bias=3.0)
    rc = psqa_gpu.main(["--tiny", "--device", "cpu", "--backends", "megatron,hf", "--max-steps", "3",
                        "--rl-seconds", "900", "--model", str(model), "--root", str(root), "--run", "pair",
                        "--out", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0, json.dumps(result["runs"], indent=1)[:3000]
    mg, hf = result["recipes"]["megatron"], result["recipes"]["hf"]
    assert mg["train"]["backend"] == "megatron" and hf["train"]["backend"] == "hf"
    assert (mg["compute"]["dtype"], mg["optim"]["moment_dtype"]) == ("bfloat16", "bfloat16")
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
        assert sum(r["rollout/search_rate"] for r in steps) > 0  # multi-turn episodes: a search, its results
        assert sum(w["searches"] for w in result["runs"][backend]["workers"]) > 0
        assert result["runs"][backend]["evals"], backend  # held-out cover-EM of published versions
        published = max(r["version"] for r in steps)
        rec = Reconstructor(store, run, plane="int8g64", public_key=load_manifest(store, run).trainer_public_key)
        rec.join()
        rec.follow()
        assert rec.version >= published, backend  # the newest version, reconstructed from its anchor and patches
        v = _verify(root, run)
        assert v.returncode == 0, v.stdout + v.stderr
    assert result["paired"]["backends"] == ["megatron", "hf"] and result["paired"]["curves"]
    assert "megatron/core" in (root / "runs" / "pair-megatron" / "learner.log").read_text()  # megatron-core ran
    assert _leftovers(tmp_path) == []
