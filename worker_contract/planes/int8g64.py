"""The `int8g64` plane: MLX affine quantization, 8 bits, groups of 64, bit-identical to
`mlx.core.quantize(w, group_size=64, bits=8)` / `mlx.core.dequantize` on the CPU (docs/pulse.md, Planes).
More in docs/pulse.md (module notes).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..tensors import is_torch, round_to, to_numpy, to_torch
from .bf16 import to_bf16, to_bf16_torch

if TYPE_CHECKING:
    import torch

NAME = "int8g64"
GROUP_SIZE = 64
BITS = 8
_LEVELS = np.float32(2**BITS - 1)
_EPS = np.float32(1e-7)
_FLOATS = ("bfloat16", "float16", "float32")


def quantize_np(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    dt = w.dtype.name
    if dt not in _FLOATS:
        raise ValueError(f"int8g64 quantizes bfloat16, float16 or float32 tensors, not dtype={dt}")
    if w.ndim < 1 or w.shape[-1] % GROUP_SIZE:
        raise ValueError(f"int8g64 needs a last dim divisible by {GROUP_SIZE}; got shape={list(w.shape)}")
    x = w.astype(np.float32).reshape(*w.shape[:-1], w.shape[-1] // GROUP_SIZE, GROUP_SIZE)
    hi, lo = x.max(axis=-1), x.min(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        s0 = np.maximum((hi - lo) / _LEVELS, _EPS)
        neg = np.abs(lo) > np.abs(hi)
        s = np.where(neg, s0, -s0)
        edge = np.where(neg, lo, hi)
        q0 = np.rint(edge / s)
        nz = q0 != 0
        scale = np.where(nz, edge / q0, s).astype(np.float32)
        bias = np.where(nz, edge, np.float32(0)).astype(np.float32)
        codes = np.rint((x - bias[..., None]) / scale[..., None])
    codes = np.clip(codes, 0, 255).astype(np.uint8).reshape(w.shape)
    wq = np.ascontiguousarray(codes).view(np.uint32)
    return wq, round_to(scale, dt), round_to(bias, dt)


def dequantize_np(wq: np.ndarray, scales: np.ndarray, biases: np.ndarray) -> np.ndarray:
    dt = scales.dtype.name
    codes = np.ascontiguousarray(wq).view(np.uint8)
    groups = codes.reshape(*codes.shape[:-1], codes.shape[-1] // GROUP_SIZE, GROUP_SIZE).astype(np.float32)
    prod = round_to(groups * scales.astype(np.float32)[..., None], dt).astype(np.float32)
    out = round_to(prod + biases.astype(np.float32)[..., None], dt)
    return out.reshape(codes.shape)


def quantize(w: Any):
    """(wq uint32, scales, biases) exactly as `mlx.core.quantize(w, group_size=64, bits=8)` on the CPU."""
    out = quantize_np(to_numpy(w))
    return tuple(to_torch(a) for a in out) if is_torch(w) else out


def dequantize(wq: Any, scales: Any, biases: Any):
    """The dense tensor (in the scales' dtype) exactly as `mlx.core.dequantize` gives it on the CPU."""
    out = dequantize_np(to_numpy(wq), to_numpy(scales), to_numpy(biases))
    return to_torch(out) if is_torch(scales) else out


def is_quantized(name: str, shape: tuple[int, ...] | list[int]) -> bool:
    """mlx-lm's rule, read from HF names: a 2-D `.weight` (Linear, Embedding, lm_head) whose last dim
    divides by 64. Norm weights and biases are 1-D; conv kernels are 3-D; neither is quantized."""
    return name.endswith(".weight") and len(shape) == 2 and shape[-1] % GROUP_SIZE == 0


def from_hf(state: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """HF-named tensors (torch or numpy, any float dtype) -> plane tensors (cast to bf16 first, as
    mlx-lm does, then quantized where the rule says)."""
    out: dict[str, np.ndarray] = {}
    for name in sorted(state):
        arr = to_bf16(state[name])
        if arr.dtype.name == "bfloat16" and is_quantized(name, arr.shape):
            mod = name[: -len(".weight")]
            out[name], out[f"{mod}.scales"], out[f"{mod}.biases"] = quantize_np(arr)
        else:
            out[name] = arr
    return out


def quantized_modules(plane_state: Mapping[str, Any]) -> list[str]:
    return sorted(k[: -len(".scales")] for k in plane_state if k.endswith(".scales"))


def to_dense(plane_state: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Plane tensors -> HF-named dense bf16 tensors (dequantized where quantized)."""
    mods = set(quantized_modules(plane_state))
    out: dict[str, np.ndarray] = {}
    for name, x in plane_state.items():
        if name.endswith((".scales", ".biases")) and name.rsplit(".", 1)[0] in mods:
            continue
        mod = name[: -len(".weight")] if name.endswith(".weight") else None
        if mod in mods:
            out[name] = dequantize_np(to_numpy(x), to_numpy(plane_state[f"{mod}.scales"]),
                                      to_numpy(plane_state[f"{mod}.biases"]))
        else:
            out[name] = to_numpy(x)
    return out


def quantized_tensors(plane_state: Mapping[str, Any]) -> list[str]:
    """Names of the plane's quantized tensors (codes, scales and biases)."""
    return sorted(f"{m}.{s}" for m in quantized_modules(plane_state) for s in ("weight", "scales", "biases"))


def quantize_torch(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(wq uint32, scales, biases) on w's device, bit-identical to `quantize_np` (and so to mlx)."""
    import torch

    dt = str(w.dtype).removeprefix("torch.")
    if dt not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"int8g64 quantizes bfloat16, float16 or float32 tensors, not dtype={dt}")
    g = GROUP_SIZE
    if w.dim() < 1 or w.shape[-1] % g:
        raise ValueError(f"int8g64 needs a last dim divisible by {g}; got shape={list(w.shape)}")
    x = w.detach().to(torch.float32).reshape(*w.shape[:-1], w.shape[-1] // g, g)
    hi, lo = x.amax(dim=-1), x.amin(dim=-1)
    levels = torch.full_like(hi, float(_LEVELS))
    s0 = torch.maximum((hi - lo) / levels, torch.full_like(hi, float(_EPS)))
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


def from_hf_torch(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """`from_hf` in torch on the tensors' device: the same bits (`quantize_torch` is `quantize_np`'s twin)."""
    out: dict[str, torch.Tensor] = {}
    for name in sorted(state):
        t = to_bf16_torch(state[name])
        if str(t.dtype) == "torch.bfloat16" and is_quantized(name, tuple(t.shape)):
            mod = name[: -len(".weight")]
            out[name], out[f"{mod}.scales"], out[f"{mod}.biases"] = quantize_torch(t)
        else:
            out[name] = t
    return out
