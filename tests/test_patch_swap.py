"""A version lands by rewriting only what its patch changed (both workers, both planes): the model after
`load_plane(new, changes)` holds bit for bit what a full load of `new` gives, `changes` (from `apply_patch`)
names only the touched tensors, and a swap that misses one changed element is caught by the same check.
A tiny Qwen2 (plain names) and a tiny LFM2-MoE (experts stacked into mlx-lm's SwitchGLU tensors, a conv
kernel transposed), every matrix a multiple of 64 wide so int8g64 quantizes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.episode_fixtures import save_search_model
from tests.worker_fixtures import save_tiny_qwen2
from worker_contract.planes import get_plane
from worker_contract.pulse import apply_patch, encode_patch

mx = pytest.importorskip("mlx.core", reason="the MLX worker needs mlx (mlx[cpu] on Linux)")
pytest.importorskip("mlx_lm", reason="the MLX worker needs mlx-lm")

ROWS = {"qwen2": ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                  "model.layers.0.mlp.down_proj.weight", "model.norm.weight"],
        "lfm2_moe": ["model.layers.1.feed_forward.experts.gate_up_proj", "model.layers.1.self_attn.k_proj.weight",
                     "model.layers.0.conv.conv.weight", "model.layers.2.feed_forward.experts.down_proj"]}


@pytest.fixture(scope="module", params=["qwen2", "lfm2_moe"])
def model_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen2":
        return request.param, save_tiny_qwen2(d, hidden_size=64, intermediate_size=128)
    return request.param, save_search_model(d, "lfm2_moe")


def _versions(arch, d, plane):
    """(old plane state, new plane state from applying the patch, the changes apply_patch reported)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(d)
    sd = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight" or not hf.config.tie_word_embeddings}
    old = get_plane(plane).from_hf(sd)
    with torch.no_grad():
        for i, name in enumerate(ROWS[arch]):
            sd[name] = sd[name].clone()
            row = (1, 60 - i) if "experts" in name else (i % sd[name].shape[0],)  # fused experts: a row of one
            sd[name][row] = sd[name][row] * 1.3 + 0.05  # one row (one output channel): codes, scales, biases
    new = get_plane(plane).from_hf(sd)
    changes: dict[str, np.ndarray] = {}
    got = apply_patch(old, encode_patch(old, new, base_version=1, target_version=2), changes_out=changes)
    assert all(np.array_equal(got[k].view(np.uint8), new[k].view(np.uint8)) for k in new)
    return old, got, changes


def _mlx_bits(policy) -> dict[str, np.ndarray]:
    from worker_contract.worker.mlx_model import flat_parameters

    out = {}
    for k, a in flat_parameters(policy.model).items():
        out[k] = np.array(a.view(mx.uint16)) if a.dtype == mx.bfloat16 else np.array(a).copy()
    return out


def _torch_bits(policy) -> dict[str, np.ndarray]:
    return {k: v.detach().clone().numpy() for k, v in policy.model.state_dict().items()}


def _differing(a: dict, b: dict) -> list[str]:
    assert set(a) == set(b)
    return sorted(k for k in a if not np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)))


def _pair(backend, d, plane, dtype):
    from worker_contract.worker.mlx_model import MlxPolicy
    from worker_contract.worker.model import PolicyModel

    if backend == "mlx":
        return [MlxPolicy(d, plane=plane, seed=0, dtype=dtype) for _ in range(2)], _mlx_bits
    return [PolicyModel(d, threads=1, seed=0, device="cpu") for _ in range(2)], _torch_bits


@pytest.mark.parametrize("plane", ["bf16", "int8g64"])
@pytest.mark.parametrize("backend,dtype", [("mlx", "float32"), ("mlx", "bfloat16"), ("torch", None)])
def test_a_patch_only_swap_equals_a_full_reload_and_a_missed_element_is_caught(model_dir, backend, dtype, plane):
    arch, d = model_dir
    old, new, changes = _versions(arch, d, plane)
    assert 0 < len(changes) < len(new) and "" not in changes
    if plane == "int8g64":  # a changed row of a quantized matrix: its codes and its groups' scales or biases
        mod = ROWS[arch][1].removesuffix(".weight")
        assert {f"{mod}.weight", f"{mod}.scales"} <= set(changes)
    (patched, full), bits = _pair(backend, d, plane, dtype)
    patched.load_plane(plane, old)
    before = bits(patched)
    wrote = patched.load_plane(plane, new, changes)
    assert wrote["elements"] < sum(a.size for a in new.values()) // 4, wrote
    full.load_plane(plane, new)
    assert _differing(bits(patched), bits(full)) == []
    assert _differing(before, bits(full)), "the patch changed nothing the models hold"
    patched.load_plane(plane, old)  # an anchor's full load replaces the arrays: the next patch writes the new ones
    patched.load_plane(plane, new, changes)
    assert _differing(bits(patched), bits(full)) == [], "a patch after a full load wrote into the replaced arrays"

    # the same swap missing one changed group of 64 (int8g64: its code words, scale and bias) or one
    # changed element (bf16): the comparison above catches it
    name = next(k for k in sorted(changes)  # not the conv kernel: the MLX worker rewrites it whole
                if k.endswith(".weight") and "conv.conv" not in k and len(changes[k]) > 1)
    if plane == "int8g64":
        mod, g = name.removesuffix(".weight"), changes[name][0] // 16
        missed = {k: (v[v // 16 != g] if k == name else v[v != g] if k.startswith(mod + ".") else v)
                  for k, v in changes.items()}
    else:
        missed = {**changes, name: changes[name][1:]}
    (short, _), _ = _pair(backend, d, plane, dtype)
    short.load_plane(plane, old)
    short.load_plane(plane, new, missed)
    assert _differing(bits(short), bits(full)), f"missing {name}[{changes[name][0]}] went unnoticed"
