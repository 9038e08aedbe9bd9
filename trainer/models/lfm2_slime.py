"""LFM2-MoE inside slime: the Megatron flags of the model and the layer-spec hook slime's model provider
calls (`--spec trainer.models.lfm2_slime lfm2_spec`), so slime builds exactly the model our converter wrote.

The spec hook reads the HF config.json from `--hf-checkpoint`; the flags come from the same file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SPEC = ["trainer.models.lfm2_slime", "lfm2_spec"]


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def model_flags(c: Mapping[str, Any], rotary: float) -> list[str]:
    """Megatron flags of an lfm2_moe config.json (the TransformerConfig trainer.models.lfm2 builds)."""
    from .lfm2 import Lfm2, dense_ffn

    Lfm2().validate(c)
    n, dense = int(c["num_hidden_layers"]), int(c.get("num_dense_layers", 2))
    heads, kv = int(c["num_attention_heads"]), int(c.get("num_key_value_heads") or c["num_attention_heads"])
    args = [
        "--spec", *SPEC, "--swiglu", "--disable-bias-linear", "--qk-layernorm",
        "--num-layers", str(n), "--hidden-size", str(c["hidden_size"]), "--ffn-hidden-size", str(dense_ffn(c)),
        "--num-attention-heads", str(heads), "--use-rotary-position-embeddings", "--rotary-base", _num(rotary),
        "--normalization", "RMSNorm", "--norm-epsilon", repr(float(c.get("norm_eps", 1e-5))),
        # our spec's norms are megatron's torch RMSNorm (WrappedTorchNorm), which asserts when the config
        # asks for the persistent fused kernel, and Megatron's parser asks for it unless told not to
        "--no-persist-layer-norm",
        "--vocab-size", str(c["vocab_size"]),
        "--num-experts", str(c["num_experts"]), "--moe-ffn-hidden-size", str(c["moe_intermediate_size"]),
        "--moe-router-topk", str(c["num_experts_per_tok"]), "--moe-router-score-function", "sigmoid",
        "--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0",
        "--moe-token-dispatcher-type", "alltoall", "--moe-layer-freq", f"[0]*{dense}+[1]*{n - dense}",
    ]
    if c.get("use_expert_bias", True):
        args += ["--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0"]
    if float(c.get("routed_scaling_factor", 1.0)) != 1.0:
        args += ["--moe-router-topk-scaling-factor", repr(float(c["routed_scaling_factor"]))]
    if kv != heads:
        args += ["--group-query-attention", "--num-query-groups", str(kv)]
    if not c.get("tie_word_embeddings", True):
        args.append("--untie-embeddings-and-output-weights")
    return args


def lfm2_spec(args: Any = None, config: Any = None, *_: Any, **__: Any):
    """Layer spec for slime's model provider (called as `spec(args, config, vp_stage)`): the per-layer
    conv/attention, dense/MoE block spec. The config gets the per-layer checkpoint keys the converter
    wrote (conv and attention layers hold different tensors)."""
    from .lfm2 import Lfm2

    if config is not None:
        config.hetereogenous_dist_checkpoint = True

    hf_dir = getattr(args, "hf_checkpoint", None)
    if hf_dir is None:
        from megatron.training import get_args

        hf_dir = get_args().hf_checkpoint
    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    return Lfm2().layer_spec(cfg, "sdpa")
