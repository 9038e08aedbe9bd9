"""Build a megatron-core GPTModel from an HF config, and move full tensors in and out of TP shards.

megatron-core is imported inside functions: it costs seconds to import and is an optional extra. The
caller initialises torch.distributed and megatron's parallel_state first (the converter does it for a
single process; the learner backend for its tensor-parallel group).

Layer specs (`attention=`: sdpa, local, te) are layer_specs.py's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .hf_io import ConvertError
from .registry import get_architecture

#: local-spec module name -> Transformer Engine spec module name (norms fused into the next linear)
_TE_RENAMES = (
    (".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight"),
    (".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight"),
)


def build_model(cfg: Mapping[str, Any], *, padded_vocab_size: int | None = None, dtype: Any = None,
                attention: str = "auto", fused: bool | None = None, init: bool = False,
                device: str | None = None) -> Any:
    """GPTModel for this HF config on this rank's tensor-parallel shard.

    `fused`: megatron's torch.compile'd SwiGLU and bias-dropout-add (default: on CUDA only, since
    inductor on CPU compiles C++ for seconds); `init`: random init. Without it weights are left empty for
    loading, but megatron then also skips tagging them with their tensor-parallel layout (partition
    dim/stride), which `shard`/`unshard` read: pass init=True whenever tensor_parallel > 1.
    """
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    arch = get_architecture(cfg)
    arch.validate(cfg)
    dtype = dtype or torch.bfloat16
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    fused = (device == "cuda") if fused is None else fused
    tp = parallel_state.get_tensor_model_parallel_world_size()
    vocab = int(padded_vocab_size or cfg["vocab_size"])
    if vocab % tp:
        raise ConvertError(f"vocab size {vocab} is not divisible by tensor_parallel={tp}; pad it (padded_vocab_size)")
    tc = TransformerConfig(
        **arch.transformer_config(cfg),
        tensor_model_parallel_size=tp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=device == "cpu",
        perform_initialization=init,
        bias_activation_fusion=fused,
        bias_dropout_fusion=fused,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    model = GPTModel(tc, arch.layer_spec(cfg, attention), **arch.gpt_model_kwargs(cfg, vocab))
    # one place sets the rotary frequencies: megatron's own rope and our fused-rope tables both read them
    model.rotary_pos_emb.inv_freq = arch.rotary_inv_freq(cfg, model.rotary_pos_emb.inv_freq)
    # the local spec builds torch RMSNorm without a dtype (fp32 weights); make the whole model one dtype
    return model.to(device=device, dtype=dtype)


def _te_name(name: str, model: Any) -> str:
    names = dict(model.named_parameters())
    if name in names:
        return name
    for old, new in _TE_RENAMES:
        if name.endswith(old) and name[: -len(old)] + new in names:
            return name[: -len(old)] + new
    return name


def shard(full: Any, param: Any, rank: int, size: int) -> Any:
    """This rank's slice of a full tensor, following megatron's partition attributes (stride-aware)."""
    import torch

    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    return torch.cat([c.chunk(size, dim=dim)[rank] for c in full.chunk(stride, dim=dim)], dim=dim)


def unshard(parts: list[Any], param: Any) -> Any:
    """Inverse of `shard`: the full tensor from every rank's slice (in rank order)."""
    import torch

    if len(parts) == 1 or not getattr(param, "tensor_model_parallel", False):
        return parts[0]
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    per_rank = [p.chunk(stride, dim=dim) for p in parts]
    return torch.cat([torch.cat([r[s] for r in per_rank], dim=dim) for s in range(stride)], dim=dim)


def load_full_state(model: Any, state: Mapping[str, Any]) -> None:
    """Copy full (unsharded) megatron tensors into this rank's parameters; every parameter must be filled."""
    import torch
    from megatron.core import parallel_state

    rank = parallel_state.get_tensor_model_parallel_rank()
    size = parallel_state.get_tensor_model_parallel_world_size()
    params = dict(model.named_parameters())
    renamed = {_te_name(k, model): v for k, v in state.items()}
    missing = sorted(set(params) - set(renamed))
    extra = sorted(set(renamed) - set(params))
    if missing or extra:
        raise ConvertError(f"state does not fit the model: missing {missing[:6]}, unexpected {extra[:6]}")
    with torch.no_grad():
        for name, p in params.items():
            part = shard(renamed[name], p, rank, size)
            if tuple(part.shape) != tuple(p.shape):
                raise ConvertError(f"{name}: shard shape {tuple(part.shape)} != parameter shape {tuple(p.shape)}")
            p.copy_(part)


def full_state(model: Any, *, device: str = "cpu") -> dict[str, Any]:
    """Every parameter gathered to its full shape, under local-spec names (collective over the TP group)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    size = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()
    back = {new: old for old, new in _TE_RENAMES}
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if size > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = unshard(parts, p)
        for new, old in back.items():
            if name.endswith(new):
                name = name[: -len(new)] + old
        out[name] = t.to(device)
    return out
