"""The `bf16` plane: every floating tensor as bfloat16 under its HF name; other dtypes kept as they are.

The cast is round-to-nearest-even, the same as torch's `.to(torch.bfloat16)`, so a trainer holding fp32
master weights publishes exactly the bf16 weights its own bf16 forward uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..tensors import is_torch, round_to, to_numpy

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
