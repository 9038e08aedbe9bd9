"""Plane conversion with torch on the tensors' own device (the learner's GPU): the same bits as `from_hf`.

The publisher diffs on the GPU when the learner's weights live there (pulse/torch_encode.py), so the plane
must be made there too: only the patch's compact streams then cross to the host. Each function here gives
bit for bit what its numpy twin gives (tests/test_planes.py checks it on the CPU against the numpy plane,
which mlx checks in turn):
More in docs/pulse.md (module notes).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from . import bf16, int8g64

if TYPE_CHECKING:
    import torch


def to_bf16_torch(t: torch.Tensor) -> torch.Tensor:
    """A fresh bf16 copy of a floating tensor (other dtypes: a fresh copy), on the tensor's device. Always
    a copy: the publisher keeps it as the next base while the learner updates its weights in place."""
    import torch

    t = t.detach()
    if t.is_floating_point():
        return t.to(torch.bfloat16, copy=True).contiguous()
    return t.clone().contiguous()


def quantize_torch(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(wq uint32, scales, biases) on w's device, bit-identical to `int8g64.quantize_np` (and so to mlx)."""
    import torch

    dt = str(w.dtype).removeprefix("torch.")
    if dt not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"int8g64 quantizes bfloat16, float16 or float32 tensors, not dtype={dt}")
    g = int8g64.GROUP_SIZE
    if w.dim() < 1 or w.shape[-1] % g:
        raise ValueError(f"int8g64 needs a last dim divisible by {g}; got shape={list(w.shape)}")
    x = w.detach().to(torch.float32).reshape(*w.shape[:-1], w.shape[-1] // g, g)
    hi, lo = x.amax(dim=-1), x.amin(dim=-1)
    levels = torch.full_like(hi, float(int8g64._LEVELS))
    s0 = torch.maximum((hi - lo) / levels, torch.full_like(hi, float(int8g64._EPS)))
    neg = lo.abs() > hi.abs()
    s = torch.where(neg, s0, -s0)
    edge = torch.where(neg, lo, hi)
    q0 = torch.round(edge / s)  # round half to even, as np.rint
    nz = q0 != 0
    scale = torch.where(nz, edge / q0, s)
    bias = torch.where(nz, edge, torch.zeros_like(edge))
    codes = torch.round((x - bias.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp_(0, 255)
    wq = codes.to(torch.uint8).reshape(w.shape).contiguous().view(torch.uint32)
    return wq, scale.to(w.dtype), bias.to(w.dtype)


def from_hf(plane: str, state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """HF-named torch tensors -> the plane's tensors (torch, on their device), as `get_plane(plane).from_hf`
    gives them in numpy."""
    if plane == bf16.NAME:
        return {name: to_bf16_torch(state[name]) for name in sorted(state)}
    if plane != int8g64.NAME:
        raise ValueError(f"DRL_PULSE_PLANE={plane!r} has no device conversion; known: {bf16.NAME}, {int8g64.NAME}")
    out: dict[str, torch.Tensor] = {}
    for name in sorted(state):
        t = to_bf16_torch(state[name])
        if str(t.dtype) == "torch.bfloat16" and int8g64.is_quantized(name, tuple(t.shape)):
            mod = name[: -len(".weight")]
            out[name], out[f"{mod}.scales"], out[f"{mod}.biases"] = quantize_torch(t)
        else:
            out[name] = t
    return out
