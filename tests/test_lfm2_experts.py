"""LFM2-MoE's experts on grouped GEMMs (trainer/models/lfm2_experts.py), fp32 on the CPU: the grouped path
equals megatron's loop over experts (forward, every gradient, and into main_grad), and the model on it
matches transformers' Lfm2MoeForCausalLM in logits and in every weight's gradient."""

from __future__ import annotations

import pytest
import torch

from tests import megatron_cpu
from tests.test_lfm2_megatron import _tiny_hf


def _loss(mg, ids):
    pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    logits = mg(ids, pos, attention_mask=None)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten())


def _grads(mg, ids):
    mg.zero_grad(set_to_none=True)
    loss = _loss(mg, ids)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in mg.named_parameters() if p.grad is not None}


def test_grouped_experts_equal_the_expert_loop(dist, tmp_path):
    from trainer.models.lfm2_experts import GroupedExperts, set_grouped, stacked

    torch.set_num_threads(2)
    state, cfg = megatron_cpu.saved_state(_tiny_hf(), tmp_path)
    mg = megatron_cpu.megatron_from_hf(cfg, state).train()
    experts = [m for m in mg.modules() if isinstance(m, GroupedExperts)]
    assert len(experts) == 3
    # the experts' weights are slices of one buffer: the grouped GEMM reads them in place, no copy
    w = [e.linear_fc1.weight for e in experts[0].local_experts]
    assert stacked(w).data_ptr() == w[0].data_ptr()
    ids = torch.randint(0, 96, (3, 17), generator=torch.Generator().manual_seed(2))
    assert set_grouped(mg, True) == 3
    loss_g, grads_g = _grads(mg, ids)
    set_grouped(mg, False)
    loss_l, grads_l = _grads(mg, ids)
    assert set(grads_g) == set(grads_l) and any(".local_experts." in n for n in grads_g)
    assert abs(loss_g - loss_l) < 1e-6
    for n in grads_l:
        assert torch.allclose(grads_g[n], grads_l[n], rtol=1e-5, atol=1e-7), n
    # with main_grad (the learner's float32 master gradients) the grouped backward adds there instead
    set_grouped(mg, True)
    for e in experts:
        for p in e.parameters():
            p.main_grad = torch.full_like(p, 0.5)
    mg.zero_grad(set_to_none=True)
    _loss(mg, ids).backward()
    for name, p in mg.named_parameters():
        if ".local_experts." in name:
            assert p.grad is None, name
            assert torch.allclose(p.main_grad - 0.5, grads_l[name], rtol=1e-5, atol=1e-7), name


def test_an_expert_that_gets_no_token_still_works(dist):
    from trainer.models.lfm2_experts import _loop_mm, grouped_mm

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(10, 64, generator=gen), torch.randn(3, 32, 64, generator=gen)
    offs = torch.tensor([4, 4, 10], dtype=torch.int32)
    assert torch.allclose(grouped_mm(x, w.transpose(1, 2), offs, "2d3d"), _loop_mm(x, w.transpose(1, 2), offs, "2d3d"))
    dy = torch.randn(10, 32, generator=gen)
    dw = grouped_mm(dy.t(), x, offs, "2d2d")
    assert dw.shape == (3, 32, 64) and torch.count_nonzero(dw[1]) == 0
    assert torch.allclose(dw[2], dy[4:].t() @ x[4:], atol=1e-5)


def test_gradients_match_transformers(dist, tmp_path):
    """Router (sigmoid, top-k on score + expert bias, renormalised, no capacity, no auxiliary loss) and
    experts as the HF model's: the same loss and the same gradient for every weight, in fp32."""
    torch.set_num_threads(2)
    hf = _tiny_hf().train()
    state, cfg = megatron_cpu.saved_state(hf, tmp_path)
    mg = megatron_cpu.megatron_from_hf(cfg, state).train()
    # token 0 is the config's pad_token_id: HF's embedding gives its row no gradient, megatron's does
    ids = torch.randint(1, 96, (2, 15), generator=torch.Generator().manual_seed(3))
    loss_mg, grads_mg = _grads(mg, ids)
    hf.zero_grad(set_to_none=True)
    logits = hf(ids).logits
    loss_hf = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten())
    loss_hf.backward()
    assert abs(float(loss_mg) - float(loss_hf)) < 1e-5
    from trainer.models.registry import get_architecture

    hf_grads = {k: v.grad for k, v in hf.named_parameters() if v.grad is not None}
    full = {n: grads_mg.get(n, torch.zeros_like(p)) for n, p in mg.named_parameters()}
    back = get_architecture(cfg).megatron_to_hf(full, cfg)
    compared = 0
    for name, g in back.items():
        if name in hf_grads:
            assert torch.allclose(g, hf_grads[name], rtol=1e-4, atol=1e-6), name
            compared += 1
        elif ".experts." in name:  # transformers keeps the experts fused: gate_up_proj [E, 2I, h], down_proj
            layer, rest = name.split(".feed_forward.experts.")
            e, proj = int(rest.split(".")[0]), rest.split(".")[1]
            fused = dict(hf.named_parameters())
            up = fused[f"{layer}.feed_forward.experts.gate_up_proj"].grad[e]
            want = {"w1": up.chunk(2)[0], "w3": up.chunk(2)[1],
                    "w2": fused[f"{layer}.feed_forward.experts.down_proj"].grad[e]}[proj]
            assert torch.allclose(g, want, rtol=1e-4, atol=1e-6), name
            compared += 1
    assert compared >= len(hf_grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_weighted_swiglu_is_the_eager_one(dtype):
    """The fused activation (megatron-core's, what CUDA runs: bias_activation_fusion) computes what the eager
    form does, forward and both gradients. Run eagerly here (no compiler needed on the CPU): its own forward
    and hand-written backward are what is checked, not the compiler."""
    from trainer.models.lfm2_experts import _weighted_bias_swiglu_impl, weighted_swiglu

    assert _weighted_bias_swiglu_impl is not None
    gen = torch.Generator().manual_seed(3)
    fc1 = torch.randn(37, 2 * 24, generator=gen).to(dtype)
    probs = torch.rand(37, generator=gen)  # the router's weights stay float32, as megatron keeps them
    dy = torch.randn(37, 24, generator=gen).to(dtype)
    out = {}
    with torch.compiler.set_stance("force_eager"):
        for fused in (False, True):
            a, p = fc1.clone().requires_grad_(), probs.clone().requires_grad_()
            y = weighted_swiglu(a, p, fused=fused)
            y.backward(dy)
            out[fused] = (y.detach().float(), a.grad.float(), p.grad.float())
    assert out[True][0].dtype == torch.float32 and y.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for name, got, want in zip(("out", "d_fc1", "d_probs"), out[True], out[False], strict=True):
        assert torch.allclose(got, want, **tol), name
