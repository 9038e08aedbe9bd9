"""Build a megatron-core GPTModel from an HF config, and move full tensors in and out of TP shards.

megatron-core is imported inside functions: it costs seconds to import and is an optional extra. The
caller initialises torch.distributed and megatron's parallel_state first (the converter does it for a
single process; the learner backend for its tensor-parallel group).

Layer specs (`attention=`):
- "sdpa" (default without Transformer Engine): the local spec with core attention replaced by torch's
  scaled_dot_product_attention (flash / memory-efficient kernels on GPU) instead of megatron's unfused
  DotProductAttention, which materialises [b*heads, s, s] scores, and linears that can accumulate
  weight gradients in float32 inside the GEMM (`fused_linear`);
- "local": megatron's stock local spec (DotProductAttention);
- "te": the Transformer Engine spec, used by "auto" when transformer_engine imports.
All three have the same parameters and the same checkpoint keys.
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


def have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError, or a broken install raising anything else
        return False
    return True


def _rope_eager(t: Any, cos: Any, sin: Any) -> Any:
    """Rotary embedding as megatron and HF apply it (rotate-half, in the activations' dtype)."""
    import torch

    half = t.shape[-1] // 2
    return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin


_ROPE: dict[str, Any] = {}


def apply_rope(t: Any, cos: Any, sin: Any) -> Any:
    """`_rope_eager`, torch.compile'd into one kernel per direction on CUDA (megatron's unfused rope is
    about ten kernels per tensor, and the learner's forward is launch-bound); eager elsewhere, and eager
    from then on if compilation fails."""
    import torch

    if not t.is_cuda or _ROPE.get("failed"):
        return _rope_eager(t, cos, sin)
    if "fn" not in _ROPE:
        _ROPE["fn"] = torch.compile(_rope_eager, dynamic=True)
    try:
        return _ROPE["fn"](t, cos, sin)
    except Exception as e:  # no triton / no compiler: the eager version is the same maths
        import logging

        logging.getLogger(__name__).warning("torch.compile of rope failed (%s); running it eagerly", e)
        _ROPE["failed"] = True
        return _rope_eager(t, cos, sin)


_SDPA: dict[str, type] = {}


def _sdpa_attention_class() -> type:
    if "cls" in _SDPA:
        return _SDPA["cls"]
    import torch.nn.functional as F
    from megatron.core.transformer.module import MegatronModule

    class SDPAttention(MegatronModule):
        """Causal core attention through torch SDPA: takes megatron's [s, b, heads, d] q/k/v, returns [s, b, h].

        `rope`: when a caller sets it to (cos, sin) [s, 1, 1, d] and runs the decoder without
        `rotary_pos_emb`, the rotary embedding is applied here, fused (`apply_rope`); GPTModel.forward
        leaves it None and megatron applies rope itself before calling us.
        """

        fuses_rope = True

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, cp_comm_type=None, pg_collection=None):
            super().__init__(config=config)
            if attention_type != "self":
                raise ValueError(f"SDPAttention supports self-attention only, got attention_type={attention_type!r}")
            self.scale = softmax_scale
            self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
            self.rope: tuple[Any, Any] | None = None

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None, **_):
            if packed_seq_params is not None or attention_bias is not None:
                raise NotImplementedError("SDPAttention: packed sequences and attention bias are not supported")
            if self.rope is not None:
                query, key = apply_rope(query, *self.rope), apply_rope(key, *self.rope)
            sq, b, nh, d = query.shape
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
            if k.shape[1] != nh:  # grouped-query attention: expand the groups to the heads
                k = k.repeat_interleave(nh // k.shape[1], dim=1)
                v = v.repeat_interleave(nh // v.shape[1], dim=1)
            p = self.dropout if self.training else 0.0
            if attention_mask is None:  # right-padded causal batches: padding never precedes a real token
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p, scale=self.scale)
            else:  # megatron's convention: True = masked out; SDPA's: True = attend
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, dropout_p=p, scale=self.scale)
            return out.permute(2, 0, 1, 3).reshape(sq, b, nh * d)

    _SDPA["cls"] = SDPAttention
    return SDPAttention


def layer_spec(attention: str = "auto") -> Any:
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if attention == "auto":
        attention = "te" if have_te() else "sdpa"
    if attention == "te":
        return specs.get_gpt_layer_with_transformer_engine_spec()
    if attention not in ("sdpa", "local"):
        raise ValueError(f"attention={attention!r}; choose one of auto, sdpa, local, te")
    spec = specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    if attention == "sdpa":
        use_main_grad_linears(spec)
        spec.submodules.self_attention.submodules.core_attention = _sdpa_attention_class()
    return spec


def use_main_grad_linears(spec: Any) -> None:
    """Swap a local layer spec's attention and MLP linears for ones that accumulate weight gradients
    into `weight.main_grad` in float32 when the learner provides it (`fused_linear`); the same
    parameters and checkpoint keys. megatron 0.19 keeps the MLP's submodules in a builder (partial)."""
    from .fused_linear import linear_classes

    column, row = linear_classes()
    attn = spec.submodules.self_attention.submodules
    attn.linear_qkv, attn.linear_proj = column, row
    mlp = spec.submodules.mlp
    sub = mlp.keywords["submodules"] if hasattr(mlp, "keywords") else mlp.submodules
    sub.linear_fc1, sub.linear_fc2 = column, row


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
