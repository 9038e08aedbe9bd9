"""LFM2-MoE's routed experts on grouped GEMMs: every expert of a micro-batch in one grouped matrix multiply
per projection (`torch._grouped_mm`, CUTLASS on Hopper), not megatron's Python loop over experts.
More in docs/performance.md (module notes).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

try:
    from megatron.core.fusions.fused_bias_swiglu import (
        weighted_bias_swiglu_impl as _weighted_bias_swiglu_impl,
    )
except ImportError:  # a megatron-core without it: the eager form
    _weighted_bias_swiglu_impl = None

log = logging.getLogger(__name__)

#: (device type, dtype, form, layout) -> whether torch's grouped GEMM gave the right answer there (probed once)
_GROUPED_OK: dict[tuple[str, str], bool] = {}


def _loop_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, form: str) -> torch.Tensor:
    """The grouped products one group at a time. form "2d3d": a [T, K] row groups, b [E, K, N] -> [T, N];
    "2d2d": a [M, T], b [T, N], groups along T -> [E, M, N]."""
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    if form == "2d3d":
        out = a.new_empty(a.shape[0], b.shape[-1])
        for e, (s, t) in enumerate(zip(starts, ends, strict=True)):
            if t > s:
                torch.mm(a[s:t], b[e], out=out[s:t])
        return out
    out = a.new_zeros(len(ends), a.shape[0], b.shape[1])
    for e, (s, t) in enumerate(zip(starts, ends, strict=True)):
        if t > s:
            torch.mm(a[:, s:t], b[s:t], out=out[e])
    return out


def _layout(t: torch.Tensor) -> str:
    return "t" if t.dim() >= 2 and t.stride(-2) == 1 and t.stride(-1) != 1 else "n"


def _probe(device: torch.device, dtype: torch.dtype, form: str, layout: str) -> bool:
    """Does torch's grouped GEMM run here, for this form, dtype and operand layout (`layout`: "n" row-major
    or "t" transposed, for a then b), with an empty group, and agree with the loop?"""
    if not hasattr(torch, "_grouped_mm"):
        return False
    gen = torch.Generator(device="cpu").manual_seed(0)
    offs = torch.tensor([48, 48, 112, 128], dtype=torch.int32, device=device)

    def make(shape: tuple[int, ...], transposed: bool) -> torch.Tensor:
        if transposed:
            return torch.randn(*shape[:-2], shape[-1], shape[-2], generator=gen).to(device, dtype).transpose(-1, -2)
        return torch.randn(*shape, generator=gen).to(device, dtype)

    shapes = ((128, 64), (4, 64, 96)) if form == "2d3d" else ((96, 128), (128, 64))
    try:
        a, b = make(shapes[0], layout[0] == "t"), make(shapes[1], layout[1] == "t")
        got = torch._grouped_mm(a, b, offs=offs).float()
        want = _loop_mm(a.float(), b.float(), offs, form)
    except (RuntimeError, TypeError, NotImplementedError, ValueError) as e:
        log.info("torch._grouped_mm (%s %s, %s, %s) unavailable (%s); experts run one by one",
                 form, layout, device, dtype, e)
        return False
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-1)
    ok = bool(torch.allclose(got, want, **tol))
    if not ok:
        log.warning("torch._grouped_mm (%s %s) disagrees with the per-expert products; experts run one by one",
                    form, layout)
    return ok


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, form: str) -> torch.Tensor:
    """torch's grouped GEMM where it runs and is right (probed once per device, dtype and form), else the loop."""
    layout = _layout(a) + _layout(b)
    key = (a.device.type, str(a.dtype), form, layout)
    if key not in _GROUPED_OK:
        _GROUPED_OK[key] = _probe(a.device, a.dtype, form, layout)
    if _GROUPED_OK[key]:
        return torch._grouped_mm(a, b, offs=offs)
    return _loop_mm(a, b, offs, form)


def stacked(weights: list[torch.Tensor]) -> torch.Tensor:
    """[E, out, in] over the experts' weights: a view when they are consecutive slices of one buffer (what
    `pack` makes), else a copy."""
    w0, n = weights[0], weights[0].numel()
    if _packed(weights):
        return torch.as_strided(w0.detach(), (len(weights), *w0.shape), (n, *w0.stride()), w0.storage_offset())
    return torch.stack([w.detach() for w in weights])


class _GroupedLinear(torch.autograd.Function):
    """y[rows of expert e] = x[rows of e] @ W_e^T for all experts at once; W_e are separate parameters."""

    @staticmethod
    def forward(ctx, x, offs, *weights):
        ctx.save_for_backward(x, offs)
        ctx.weights = weights
        return grouped_mm(x, stacked(list(weights)).transpose(1, 2), offs, "2d3d")

    @staticmethod
    def backward(ctx, dy):
        x, offs = ctx.saved_tensors
        weights = ctx.weights
        dy = dy.contiguous()
        dx = grouped_mm(dy, stacked(list(weights)), offs, "2d3d") if ctx.needs_input_grad[0] else None
        if not any(ctx.needs_input_grad[2:]):
            return dx, None, *([None] * len(weights))
        dw = grouped_mm(dy.t(), x, offs, "2d2d")               # [E, out, in]
        if all(hasattr(w, "main_grad") for w in weights):   # the learner's float32 master gradients
            mains = [w.main_grad for w in weights]
            torch._foreach_add_(mains, list(dw.to(mains[0].dtype).unbind(0)))
            return dx, None, *([None] * len(weights))
        return dx, None, *dw.to(weights[0].dtype).unbind(0)


def _packed(weights: list[torch.Tensor]) -> bool:
    w0, n = weights[0], weights[0].numel()
    return all(w.is_contiguous() and w.untyped_storage().data_ptr() == w0.untyped_storage().data_ptr()
               and w.storage_offset() == w0.storage_offset() + e * n for e, w in enumerate(weights))


def pack(experts: SequentialMLP) -> None:
    """Lay the experts' fc1 and fc2 weights out as consecutive slices of one buffer each, in place (the
    parameters stay the same objects, with the same values)."""
    for name in ("linear_fc1", "linear_fc2"):
        ws = [getattr(e, name).weight for e in experts.local_experts]
        if not _packed(ws):
            buf = torch.stack([w.detach() for w in ws])
            for e, w in enumerate(ws):
                w.data = buf[e]


class GroupedExperts(SequentialMLP):
    """SequentialMLP's parameters, all experts in one grouped GEMM per projection (module docstring)."""

    #: False runs SequentialMLP's own loop over experts (to compare)
    grouped = True

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        cfg = self.config
        if not (cfg.gated_linear_unit and cfg.activation_func is F.silu) or cfg.add_bias_linear:
            raise ValueError("GroupedExperts: LFM2's SwiGLU experts without biases only")
        # sharded experts need megatron's per-expert reductions, which the grouped products skip: its loop
        self.can_group = self.tp_group.size() == 1 and self.ep_group.size() == 1
        self.grouped = self.can_group
        if self.can_group:
            pack(self)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor, **kwargs: Any):
        if not self.grouped or kwargs or self.config.moe_apply_probs_on_input or self.num_local_experts == 1:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs, **kwargs)
        x = permuted_local_hidden_states
        offs = torch.as_tensor(tokens_per_expert).to(device=x.device).cumsum(0, dtype=torch.int32)
        fc1 = _GroupedLinear.apply(x, offs, *[e.linear_fc1.weight for e in self.local_experts])
        inter = weighted_swiglu(fc1, permuted_probs, fused=self.config.bias_activation_fusion)
        out = _GroupedLinear.apply(inter, offs, *[e.linear_fc2.weight for e in self.local_experts])
        return out, None


def weighted_swiglu(fc1: torch.Tensor, probs: torch.Tensor, *, fused: bool) -> torch.Tensor:
    """silu(gate) * up * routing weight, cast back to fc1's dtype, as megatron's MLP computes it. `fused`
    (the model's bias_activation_fusion, on for CUDA) runs megatron-core's fused weighted SwiGLU: one
    compiled kernel each way that saves only fc1 and the weights for backward, where the eager form keeps
    two more activations of fc1's half-width per layer and reads and writes each of them again."""
    if fused and _weighted_bias_swiglu_impl is not None:
        return _weighted_bias_swiglu_impl(fc1, None, probs.unsqueeze(-1))
    gate, up = fc1.chunk(2, dim=-1)
    return (F.silu(gate) * up * probs.unsqueeze(-1)).to(fc1.dtype)


def set_grouped(model: torch.nn.Module, on: bool) -> int:
    """Switch every GroupedExperts in `model` between grouped GEMMs and megatron's loop; returns how many."""
    n = 0
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.grouped = on and m.can_group
            n += 1
    return n
