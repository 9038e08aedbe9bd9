"""The megatron-core layer specs every architecture builds on, and the pieces they swap in: core attention
through torch SDPA with the rotary embedding fused in, and linears that accumulate float32 weight
gradients in the GEMM (`fused_linear`). megatron-core is imported inside functions.
More in docs/extending.md (module notes).
"""

from __future__ import annotations

from typing import Any


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


def sdpa_attention_class() -> type:
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
        spec.submodules.self_attention.submodules.core_attention = sdpa_attention_class()
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
