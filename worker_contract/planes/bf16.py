"""The `bf16` plane: every floating tensor as bfloat16 under its HF name; other dtypes kept as they are.

The cast is round-to-nearest-even, the same as torch's `.to(torch.bfloat16)`, so a trainer holding fp32
master weights publishes exactly the bf16 weights its own bf16 forward uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..tensors import is_torch, round_to, to_numpy

if TYPE_CHECKING:
    import torch

NAME = "bf16"


def to_bf16(x: Any) -> np.ndarray:
    """A tensor (torch or numpy) as a numpy bf16 array if it is floating, else unchanged."""
    if is_torch(x):
        import torch

        if x.is_floating_point() and x.dtype != torch.bfloat16:
            x = x.detach().to(torch.bfloat16)
        return to_numpy(x)
    arr = np.asarray(x)
    if arr.dtype.name == "bfloat16" or arr.dtype.kind not in "fV":
        return arr
    return round_to(arr.astype(np.float32), "bfloat16").reshape(arr.shape)


def from_hf(state: Mapping[str, Any]) -> dict[str, np.ndarray]:
    return {name: to_bf16(state[name]) for name in sorted(state)}


def to_dense(plane_state: Mapping[str, Any]) -> dict[str, np.ndarray]:
    return {name: to_numpy(x) for name, x in plane_state.items()}


def quantized_tensors(plane_state: Mapping[str, Any]) -> list[str]:
    return []


def to_bf16_torch(t: torch.Tensor) -> torch.Tensor:
    """A fresh bf16 copy of a floating tensor (other dtypes: a fresh copy), on the tensor's device. Always
    a copy: the publisher keeps it as the next base while the learner updates its weights in place."""
    import torch

    t = t.detach()
    if t.is_floating_point():
        return t.to(torch.bfloat16, copy=True).contiguous()
    return t.clone().contiguous()


def from_hf_torch(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """`from_hf` in torch on the tensors' device: the same bits, fresh copies."""
    return {name: to_bf16_torch(state[name]) for name in sorted(state)}
