"""The slime launch (infra/slime_launch.py, trainer/models/lfm2_slime.py) against what slime and Megatron do
with it: the model the flags ask for builds from our spec, and the launch keeps each run's files its own."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests import megatron_cpu


def _psqa_flags(**over) -> list[str]:
    from infra import slime_launch as sl
    from trainer.config import resolve

    cfg = resolve("psqa", env={"DRL_RUN": "launch"}, overrides={"train.engine": "slime", **over})
    return sl.slime_args(cfg, sl.BoxPaths(remote_dir="/root/dRL", run="launch"), sl.KNOWN_HF_CONFIGS[cfg.model.hf_id])


def test_lfm2_flags_build_our_spec_with_megatrons_norm_setting(tmp_path):
    """Megatron's `core_transformer_config_from_args` sets persist_layer_norm = not --no-persist-layer-norm;
    our spec's torch RMSNorm asserts on True, so the launch must pass the flag (the model never built without)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    from tests.test_lfm2_megatron import _tiny_hf
    from trainer.models import get_architecture, load_hf_config
    from trainer.models.lfm2_slime import lfm2_spec

    flags = _psqa_flags()
    _tiny_hf(tmp_path)
    cfg = load_hf_config(tmp_path)
    arch = get_architecture(cfg)
    megatron_cpu.init_distributed()
    try:
        tc = TransformerConfig(**arch.transformer_config(cfg), params_dtype=torch.float32, use_cpu_initialization=True,
                               persist_layer_norm="--no-persist-layer-norm" not in flags)
        spec = lfm2_spec(SimpleNamespace(hf_checkpoint=str(tmp_path)), tc, None)  # as slime's provider calls it
        model = GPTModel(tc, spec, **arch.gpt_model_kwargs(cfg, cfg["vocab_size"]))
    finally:
        megatron_cpu.shutdown_distributed()
    assert any(n.endswith("final_layernorm.weight") for n, _ in model.named_parameters())


@pytest.mark.parametrize("recipe", ["gsm8k", "psqa"])
def test_each_run_compiles_into_its_own_cache(recipe):
    """slime's policy loss is torch.compile'd with the clip bounds baked in; a cache shared between runs
    on one box can hand one run another's kernels. Each run's inductor and triton caches live in its dir."""
    from infra import slime_launch as sl
    from trainer.config import resolve

    envs = []
    for run in ("run-a", "run-b"):
        cfg = resolve(recipe, env={"DRL_RUN": run}, overrides={"train.engine": "slime"})
        paths = sl.BoxPaths(remote_dir="/root/dRL", run=run)
        env = sl.runtime_env(cfg, paths)["env_vars"]
        for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
            assert env[var].startswith(paths.state_dir + "/"), (var, env[var])
        envs.append(env)
    assert envs[0]["TORCHINDUCTOR_CACHE_DIR"] != envs[1]["TORCHINDUCTOR_CACHE_DIR"]
    assert envs[0]["TRITON_CACHE_DIR"] != envs[1]["TRITON_CACHE_DIR"]


def test_the_disk_need_follows_the_engines_checkpoint():
    """A native-engine checkpoint is its fp32 masters and Adam's moments in optim.moment_dtype (8 bytes a
    parameter with bf16 moments, 12 with fp32), a slime one 14; both keep K + 1 beside the model's two copies."""
    from infra import slime_launch as sl
    from trainer.config import resolve

    need = {}
    for recipe, hf_id in (("psqa", "LiquidAI/LFM2.5-8B-A1B"), ("gsm8k", "Qwen/Qwen2.5-1.5B-Instruct")):
        for engine in ("native", "slime"):
            cfg = resolve(recipe, {}, {"run": "x", "train.engine": engine})
            need[recipe, engine] = (sl.checkpoint_bytes(cfg), sl.disk_need_gb(cfg, sl.KNOWN_HF_CONFIGS[hf_id]))
    # psqa: 8.34 B parameters, bf16 moments, keep 1; gsm8k: 1.54 B, fp32 moments, keep 2
    assert need == {("psqa", "native"): (8, 172), ("psqa", "slime"): (14, 272),
                    ("gsm8k", "native"): (12, 67), ("gsm8k", "slime"): (14, 76)}


@pytest.mark.parametrize(("recipe", "profile", "free_gb", "ok"), [
    ("psqa", "fleet", 250, False), ("psqa", "fleet", 280, True),
    ("gsm8k", "quickstart", 70, False), ("gsm8k", "quickstart", 80, True),
])
def test_the_preflight_asks_for_the_disk_the_checkpoints_take(tmp_path, recipe, profile, free_gb, ok):
    """Each slime checkpoint is 14 bytes a parameter (21.6 GB for Qwen2.5-1.5B, 116.8 GB for LFM2.5-8B-A1B),
    kept K + 1 at a time (checkpoint.keep, then the save in progress), beside the model's two copies."""
    from infra import slime_launch as sl
    from infra.preflight import build_context
    from infra.preflight_env import check_disk
    from tests.test_preflight import make_plan

    hf = sl.KNOWN_HF_CONFIGS[{"psqa": "LiquidAI/LFM2.5-8B-A1B", "gsm8k": "Qwen/Qwen2.5-1.5B-Instruct"}[recipe]]
    assert round(sl.model_params(hf) * sl.CHECKPOINT_BYTES / 1e9, 1) == {"psqa": 116.8, "gsm8k": 21.6}[recipe]
    plan = make_plan(profile, f"file://{tmp_path}/bucket")
    df = f"/dev/x 1 1 {free_gb * 10**9 // 1024} 1% /\n"
    ctx = build_context(plan, profile=profile, env={}, run_box=lambda cmd: (0, df))
    row = check_disk(ctx)
    assert (row.status == "PASS") is ok, row
    assert row.required == f">= {sl.disk_need_gb(ctx.cfg, hf):.0f} GB"
    assert ok or f"{ctx.cfg.checkpoint.keep} + 1 slime-engine checkpoints" in row.fix


def test_the_model_flags_come_from_the_architecture_registry():
    """Each architecture carries its slime flags (trainer/models/registry.py); one without them (dense LFM2) or an
    unknown model_type is refused in one sentence that names the way out."""
    from infra import slime_launch as sl
    from trainer.config import resolve
    from trainer.models.registry import get_architecture

    cfg = resolve("psqa", {}, {"run": "x", "train.engine": "slime"})
    hf = dict(sl.KNOWN_HF_CONFIGS["LiquidAI/LFM2.5-8B-A1B"])
    assert sl.model_args(cfg, hf) == get_architecture(hf).slime_model_flags(hf, sl.rotary_base(cfg, hf))
    assert "--no-persist-layer-norm" in sl.model_args(cfg, hf)
    with pytest.raises(ValueError, match="no Megatron-LM flags for the slime engine.*native engine"):
        sl.model_args(cfg, {**hf, "model_type": "lfm2"})
    with pytest.raises(ValueError, match="model_type='mamba9' has no Megatron mapping"):
        sl.model_args(cfg, {**hf, "model_type": "mamba9"})
