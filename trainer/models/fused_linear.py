"""Megatron linear layers whose weight gradients are accumulated in float32 inside the GEMM.

Why: the learner computes in bf16 and keeps float32 master weights; adding each micro-batch's bf16 weight
gradient into the master in a separate pass costs a pass and a rounding. Here cuBLAS does it inside the
weight-gradient GEMM, through torch, where the installed torch supports it (probed once per device).
More in docs/performance.md (module notes).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

_PROBED: dict[Any, bool] = {}


def accumulate_wgrad(main_grad: Any, grad_out: Any, inputs: Any, *, fused: bool | None = None) -> None:
    """main_grad += grad_out.T @ inputs, for 2-D grad_out [n, out] and inputs [n, in]; float32 main_grad.

    `fused` (default: probed for main_grad's device) adds inside the GEMM; otherwise the product is
    formed from float32 copies of the operands (exact products of bf16 values; slower, used on the CPU)
    and added.
    """
    import torch

    if fused is None:
        fused = fused_wgrad_available(main_grad.device)
    if fused:
        torch.addmm(main_grad, grad_out.t(), inputs, out_dtype=torch.float32, out=main_grad)
    else:
        main_grad.add_(grad_out.t().float() @ inputs.float())


def fused_wgrad_available(device: Any) -> bool:
    """True when `torch.addmm(f32, bf16, bf16, out_dtype=f32, out=f32)` runs here and gives the right sum."""
    import torch

    device = torch.device(device)
    if device not in _PROBED:
        _PROBED[device] = device.type == "cuda" and _probe(device)
    return _PROBED[device]


def _probe(device: Any) -> bool:
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    g = torch.randn(192, 96, device=device, generator=gen).to(torch.bfloat16)   # [tokens, out]
    x = torch.randn(192, 64, device=device, generator=gen).to(torch.bfloat16)   # [tokens, in]
    acc = torch.randn(96, 64, device=device, generator=gen)
    want = acc + g.float().t() @ x.float()
    try:
        accumulate_wgrad(acc, g, x, fused=True)
    except (RuntimeError, TypeError, NotImplementedError) as e:
        log.info("float32 gradient accumulation inside the GEMM unavailable here (%s); accumulating separately", e)
        return False
    ok = bool(torch.allclose(acc, want, rtol=1e-3, atol=1e-3))
    if not ok:
        log.warning("torch.addmm(out_dtype=float32) into a float32 addend gave a wrong sum; accumulating separately")
    return ok


def _linear_into_main_grad():
    import torch
    import torch.distributed as dist

    class LinearIntoMainGrad(torch.autograd.Function):
        """y = x W^T (+ b). Backward: dx as usual (all-reduced over the TP group when asked, overlapped with
        the weight-gradient GEMM), dW accumulated into W.main_grad and not returned to autograd."""

        @staticmethod
        def forward(ctx, x, weight, bias, allreduce_dgrad, tp_group):
            ctx.save_for_backward(x, weight)
            # the parameter's own main_grad, held here: under recompute (non-reentrant checkpoint) the saved
            # weight comes back as a fresh tensor without the attribute
            ctx.main_grad = weight.main_grad
            ctx.has_bias, ctx.allreduce_dgrad, ctx.tp_group = bias is not None, allreduce_dgrad, tp_group
            out = torch.matmul(x, weight.t())
            return out + bias if bias is not None else out

        @staticmethod
        def backward(ctx, grad_out):
            x, weight = ctx.saved_tensors
            grad_x = grad_out.matmul(weight)
            handle = None
            if ctx.allreduce_dgrad and ctx.tp_group is not None and dist.get_world_size(ctx.tp_group) > 1:
                handle = dist.all_reduce(grad_x, group=ctx.tp_group, async_op=True)
            g2 = grad_out.reshape(-1, grad_out.shape[-1])
            accumulate_wgrad(ctx.main_grad, g2, x.reshape(-1, x.shape[-1]))
            grad_b = g2.sum(0) if ctx.has_bias else None
            if handle is not None:
                handle.wait()
            return grad_x, None, grad_b, None, None

    return LinearIntoMainGrad


_CLASSES: dict[str, Any] = {}


def _forward_impl_with_main_grad(base: type) -> Any:
    def _forward_impl(self, input, weight, *args, **kwargs):  # noqa: A002 (megatron's keyword names)
        usable = (weight.requires_grad and hasattr(weight, "main_grad") and not args
                  and not kwargs.get("sequence_parallel") and kwargs.get("grad_output_buffer") is None
                  and kwargs.get("gtp_remat_size") in (None, 0, 1))
        if not usable:
            return base._forward_impl(self, input, weight, *args, **kwargs)
        return _CLASSES["fn"].apply(input, weight, kwargs.get("bias"), bool(kwargs.get("allreduce_dgrad")),
                                    kwargs.get("tp_group"))

    return _forward_impl


def linear_classes() -> tuple[type, type]:
    """(column-parallel, row-parallel) linear classes for a layer spec: megatron's, with the fused
    float32 weight-gradient accumulation when the weight carries `main_grad`."""
    if "column" not in _CLASSES:
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        _CLASSES["fn"] = _linear_into_main_grad()
        _CLASSES["column"] = type("MainGradColumnParallelLinear", (ColumnParallelLinear,),
                                  {"_forward_impl": _forward_impl_with_main_grad(ColumnParallelLinear),
                                   "__doc__": "ColumnParallelLinear accumulating dW into weight.main_grad."})
        _CLASSES["row"] = type("MainGradRowParallelLinear", (RowParallelLinear,),
                               {"_forward_impl": _forward_impl_with_main_grad(RowParallelLinear),
                                "__doc__": "RowParallelLinear accumulating dW into weight.main_grad."})
    return _CLASSES["column"], _CLASSES["row"]


def is_main_grad_linear(module: Any) -> bool:
    return "column" in _CLASSES and isinstance(module, (_CLASSES["column"], _CLASSES["row"]))
