"""Llama (2, 3, 3.x) <-> megatron-core: Qwen2's tensor names and layout (qwen2.py's table) without the
query/key/value biases, and Llama 3.x's rope scaling (`rope_type: llama3`) applied to the rotary
frequencies. Parity with transformers' LlamaForCausalLM, plain and scaled, is tested in tests/test_llama.py.

llama3 scaling keeps the high frequencies (wavelength below original_max_position_embeddings /
high_freq_factor), divides the low ones (wavelength above original / low_freq_factor) by `factor`, and
blends the two in between, linearly in original / wavelength.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .arch import flag_number
from .hf_io import ConvertError, refuse_unsupported, rope_scaling_of
from .qwen2 import Qwen2, _shape


def llama3_inv_freq(inv_freq: Any, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: int, **_: Any) -> Any:
    """Plain rotary inverse frequencies -> Llama 3.x's scaled ones (same op order as transformers', so
    float32 results are bit-identical)."""
    import torch

    old = float(original_max_position_embeddings)
    wavelen = 2 * math.pi / inv_freq
    low = wavelen > old / low_freq_factor    # long wavelengths: divided by factor
    high = wavelen < old / high_freq_factor  # short wavelengths: kept
    scaled = torch.where(low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    return torch.where(~low & ~high, blended, scaled)


#: the llama3 scaling Megatron-LM's --use-rope-scaling applies (megatron-core RotaryEmbedding._apply_scaling
#: fixes all but the factor)
MEGATRON_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class Llama(Qwen2):
    model_types = ("llama",)
    qkv_kinds = ("weight",)

    def validate(self, cfg: Mapping[str, Any]) -> None:
        nh, ng, d = _shape(cfg)
        checks = [
            (cfg.get("hidden_act", "silu") == "silu", f"hidden_act={cfg.get('hidden_act')!r} (only silu)"),
            (not cfg.get("attention_bias", False), "attention_bias=true (biases on q/k/v/o)"),
            (not cfg.get("mlp_bias", False), "mlp_bias=true"),
            (nh % ng == 0, f"num_attention_heads={nh} not a multiple of num_key_value_heads={ng}"),
        ]
        refuse_unsupported(cfg, checks, rope_scaling=True)

    def transformer_config(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        return {**super().transformer_config(cfg), "add_qkv_bias": False}

    def slime_rope_flags(self, cfg: Mapping[str, Any]) -> list[str]:
        """Llama 3.x's rope scaling as Megatron-LM's flags; a scaling they cannot express is refused."""
        scaling = rope_scaling_of(cfg)
        if scaling is None:
            return []
        if {k: scaling[k] for k in MEGATRON_LLAMA3} != MEGATRON_LLAMA3:
            raise ConvertError(
                f"model_type='llama' with rope scaling {scaling}: slime's Megatron-LM applies llama3 scaling only "
                f"with {MEGATRON_LLAMA3} (--use-rope-scaling); use the native engine for this model")
        return ["--use-rope-scaling", "--rope-scaling-factor", flag_number(scaling["factor"])]

    def rotary_inv_freq(self, cfg: Mapping[str, Any], inv_freq: Any) -> Any:
        scaling = rope_scaling_of(cfg)
        return inv_freq if scaling is None else llama3_inv_freq(inv_freq, **scaling)
