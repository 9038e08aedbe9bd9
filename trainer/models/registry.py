"""The per-architecture registry: one small class per HF `model_type`, registered in one place.

To add an architecture: copy qwen2.py, override what differs (its layer spec, its tensors, its name
table; the interface is arch.Architecture), and add it to `ARCHITECTURES` below.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .arch import Architecture
from .hf_io import ConvertError
from .lfm2 import Lfm2
from .llama import Llama
from .qwen2 import Qwen2


def _registry() -> dict[str, Architecture]:
    out: dict[str, Architecture] = {}
    for arch in (Qwen2(), Llama(), Lfm2()):
        for mt in arch.model_types:
            out[mt] = arch
    return out


ARCHITECTURES: dict[str, Architecture] = _registry()


def get_architecture(cfg_or_type: Mapping[str, Any] | str) -> Architecture:
    """The registered architecture for an HF config (or a model_type); unknown ones are refused."""
    mt = cfg_or_type if isinstance(cfg_or_type, str) else cfg_or_type.get("model_type")
    if mt not in ARCHITECTURES:
        raise ConvertError(
            f"model_type={mt!r} has no Megatron mapping; known: {', '.join(sorted(ARCHITECTURES))} "
            "(add one in trainer/models/registry.py)"
        )
    return ARCHITECTURES[mt]
