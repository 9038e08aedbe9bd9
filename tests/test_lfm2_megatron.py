"""LFM2-MoE on megatron-core: forward parity with transformers' own Lfm2MoeForCausalLM (tiny random
config, fp32, CPU), exact HF <-> Megatron name round trip, and HF -> torch_dist -> HF through the
converter CLI in a real process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests import megatron_cpu

REPO = Path(__file__).resolve().parent.parent
LAYERS = ["conv", "full_attention", "conv", "full_attention", "conv"]


def _tiny_hf(out: Path | None = None, dtype=torch.float32):
    from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM

    torch.manual_seed(0)
    cfg = Lfm2MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                        num_hidden_layers=len(LAYERS), num_attention_heads=4, num_key_value_heads=2,
                        num_dense_layers=2, num_experts=4, num_experts_per_tok=2, layer_types=LAYERS)
    cfg._attn_implementation = "eager"
    model = Lfm2MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # norms and expert bias random too, so a dropped or swapped one changes logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif name.endswith("feed_forward.gate.weight"):  # routing that varies token by token
                p.normal_(0.0, 0.3)
        for name, b in model.named_buffers():
            if "expert_bias" in name:
                b.normal_(0.0, 0.1)
    model = model.to(dtype)
    if out is not None:
        megatron_cpu.save_with_tokenizer(model, out, 96)
    return model




def test_forward_parity_with_transformers(dist, tmp_path):
    torch.set_num_threads(2)
    hf = _tiny_hf()
    state, cfg = megatron_cpu.saved_state(hf, tmp_path)
    mg = megatron_cpu.megatron_from_hf(cfg, state)
    ids = torch.randint(0, 96, (3, 13), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(13)[None].expand(3, -1)
    with torch.no_grad():
        ref = hf(ids).logits
        out = mg(ids, pos, attention_mask=None)
    assert out.shape == ref.shape
    diff = (out - ref).abs().max().item()
    assert diff < 1e-5, f"max |logit diff| {diff}"
    # the comparison is sensitive: moving the expert bias (routing) or one conv tap changes the logits
    # (a bias raised on one expert only: a shift shared by all experts would not change the routing)
    for key, delta in (("model.layers.3.feed_forward.expert_bias", torch.tensor([0.0, 0.0, 0.4, 0.0])),
                       ("model.layers.0.conv.conv.weight", 0.05)):
        bent = dict(state)
        bent[key] = state[key] + delta
        with torch.no_grad():
            assert (megatron_cpu.megatron_from_hf(cfg, bent)(ids, pos, attention_mask=None) - ref).abs().max().item() > 1e-4, key
    # megatron's own (unfused) attention gives the same logits given an explicit causal mask
    mask = torch.triu(torch.ones(1, 1, 13, 13, dtype=torch.bool), 1)
    with torch.no_grad():
        assert (megatron_cpu.megatron_from_hf(cfg, state, "local")(ids, pos, attention_mask=mask) - ref).abs().max().item() < 1e-5


def test_gradients_flow_but_expert_bias_is_frozen(dist, tmp_path):
    state, cfg = megatron_cpu.saved_state(_tiny_hf(), tmp_path)
    mg = megatron_cpu.megatron_from_hf(cfg, state).train()
    ids = torch.randint(0, 96, (2, 9))
    loss = mg(ids, torch.arange(9)[None].expand(2, -1), attention_mask=None, labels=ids).mean()
    loss.backward()
    grads = {n: p.grad for n, p in mg.named_parameters()}
    assert grads["decoder.layers.0.self_attention.conv_weight"].abs().sum() > 0
    assert grads["decoder.layers.0.self_attention.in_proj.weight"].abs().sum() > 0
    assert all(grads[n] is None for n in grads if n.endswith("expert_bias"))
    assert sum(1 for n in grads if n.endswith("expert_bias")) == 3


def test_name_round_trip_is_exact(dist, tmp_path):
    from trainer.models.model import full_state
    from trainer.models.registry import get_architecture

    state, cfg = megatron_cpu.saved_state(_tiny_hf(), tmp_path)
    arch = get_architecture(cfg)
    back = arch.megatron_to_hf(full_state(megatron_cpu.megatron_from_hf(cfg, state)), cfg)
    assert set(back) == set(state)
    assert all(torch.equal(back[k].float(), state[k].float()) for k in state)
    # transformers' fused in-memory expert form maps to the same Megatron tensors
    fused = {k: v for k, v in state.items() if ".experts." not in k}
    for i in (2, 3, 4):
        f = f"model.layers.{i}.feed_forward.experts."
        fused[f + "gate_up_proj"] = torch.stack([torch.cat([state[f"{f}{e}.w1.weight"], state[f"{f}{e}.w3.weight"]]) for e in range(4)])
        fused[f + "down_proj"] = torch.stack([state[f"{f}{e}.w2.weight"] for e in range(4)])
    a, b = arch.hf_to_megatron(state, cfg, 96), arch.hf_to_megatron(fused, cfg, 96)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_unsupported_configs_are_refused(tmp_path):
    from trainer.models.hf_io import ConvertError
    from trainer.models.registry import get_architecture

    _, cfg = megatron_cpu.saved_state(_tiny_hf(), tmp_path)
    arch = get_architecture(cfg)
    for bad in ({"conv_bias": True}, {"norm_topk_prob": False}, {"layer_types": ["conv"] * 4 + ["sliding"]}):
        with pytest.raises(ConvertError, match="unsupported"):
            arch.validate({**cfg, **bad})


@pytest.mark.integration
def test_convert_cli_round_trip(tmp_path):
    from safetensors.torch import load_file

    hf_dir = tmp_path / "hf"
    _tiny_hf(hf_dir, dtype=torch.bfloat16)
    out = megatron_cpu.convert_round_trip(hf_dir, tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "td" / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    a, b = load_file(hf_dir / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k].float(), b[k].float()) for k in a)


def test_gpu_parity_bench_runs_tiny_on_cpu(dist, tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("lfm2_gpu_bench", REPO / "bench" / "lfm2_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "lfm2_gpu.json"
    assert bench.main(["--tiny", "--device", "cpu", "--dtype", "float32", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["shape"]["layers"] == 4 and result["dtype"] == "float32"
    assert result["token_logprob_max_abs_diff"] < 1e-4 and result["top1_agreement"] == 1.0
    assert len(result["commit"]) >= 7 and result["machine"]["cores"] and "--tiny" in result["command"]


def test_published_weights_have_the_layout_a_torch_worker_loads(dist, tmp_path):
    """The megatron backend publishes what the hf backend publishes for the same model: the installed
    transformers' in-memory names and shapes (transformers 5 holds the experts fused, [E, 2I, h] and [E, h, I]),
    with the same values; per-expert Hub names would not load into a torch worker's model."""
    from trainer.backends.hf import HFBackend
    from trainer.backends.megatron import MegatronBackend
    from trainer.config import ModelConfig, RecipeConfig, TrainConfig

    _tiny_hf(tmp_path)
    cfg = RecipeConfig(name="t", task="arithmetic", model=ModelConfig(dtype="float32"), train=TrainConfig())
    mg = MegatronBackend.load(tmp_path, cfg.model_copy(update={"train": TrainConfig(backend="megatron")}),
                              device="cpu", attention="sdpa")
    hf = HFBackend.load(tmp_path, cfg, device="cpu").publish_snapshot()
    for got in (mg.publish_snapshot(), mg.state_dict_hf()):
        assert got.keys() == hf.keys(), sorted(set(got) ^ set(hf))[:6]
        for k, v in hf.items():
            assert got[k].shape == v.shape and torch.equal(got[k], v), k
