"""The per-architecture registry: one small class per HF `model_type`, registered in one place.

An architecture says how its HF config becomes a megatron-core model and how its tensors map both ways.
Megatron-side names are the module names of the local layer spec (`model.state_dict()`); the
checkpoint keys are produced from them by megatron's own `sharded_state_dict`, so one mapping serves
the local and the Transformer Engine spec alike.

To add an architecture (LFM2, say): copy qwen2.py to lfm2.py, override what differs (its layer spec for
the conv blocks, its MoE tensors, its name table), and add it to `ARCHITECTURES` below.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .hf_io import ConvertError


class Architecture:
    """Interface every architecture implements (see qwen2.py for the reference implementation)."""

    #: HF `model_type` values this class converts
    model_types: tuple[str, ...] = ()

    def validate(self, cfg: Mapping[str, Any]) -> None:
        """Raise ConvertError for any config feature the mapping does not support."""
        raise NotImplementedError

    def transformer_config(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        """megatron TransformerConfig fields that describe the model's shape and maths."""
        raise NotImplementedError

    def gpt_model_kwargs(self, cfg: Mapping[str, Any], padded_vocab_size: int) -> dict[str, Any]:
        """Keyword arguments of GPTModel besides config and layer spec."""
        raise NotImplementedError

    def hf_to_megatron(self, hf: Mapping[str, Any], cfg: Mapping[str, Any], padded_vocab_size: int) -> dict[str, Any]:
        """Full (unsharded) HF tensors -> full megatron tensors under local-spec module names."""
        raise NotImplementedError

    def megatron_to_hf(self, mg: Mapping[str, Any], cfg: Mapping[str, Any]) -> dict[str, Any]:
        """Full megatron tensors -> HF tensors (the exact inverse of hf_to_megatron)."""
        raise NotImplementedError

    def layer_spec(self, cfg: Mapping[str, Any], attention: str = "auto") -> Any:
        """The transformer layer spec (or per-layer block spec) GPTModel is built with; one spec for every
        layer by default, overridden by hybrid architectures (LFM2)."""
        from .model import layer_spec

        return layer_spec(attention)


def _registry() -> dict[str, Architecture]:
    from .lfm2 import Lfm2
    from .qwen2 import Qwen2

    out: dict[str, Architecture] = {}
    for arch in (Qwen2(), Lfm2()):
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
            "(add one in infra/convert/registry.py)"
        )
    return ARCHITECTURES[mt]
