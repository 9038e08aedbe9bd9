"""Qwen2 / Qwen2.5 <-> megatron-core (local spec names). Verified bit-exact in tests/test_convert.py.
More in docs/extending.md (module notes).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .arch import Architecture, HfTensors, flag_number
from .hf_io import refuse_unsupported, rope_theta_of

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
#: HF buffers that carry no weights
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")

#: per-layer HF suffix -> megatron suffix, for the 1:1 tensors
_DIRECT = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}


def _shape(cfg: Mapping[str, Any]) -> tuple[int, int, int]:
    nh = int(cfg["num_attention_heads"])
    ng = int(cfg.get("num_key_value_heads") or nh)
    d = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // nh)
    return nh, ng, d


def interleave_qkv(q: Any, k: Any, v: Any, nh: int, ng: int, d: int) -> Any:
    """[q; k; v] (HF, separate) -> megatron's fused per-group layout. Works for weights and biases."""
    import torch

    r = nh // ng
    tail = q.shape[1:]
    parts = (q.reshape(ng, r * d, *tail), k.reshape(ng, d, *tail), v.reshape(ng, d, *tail))
    return torch.cat(parts, dim=1).reshape((nh + 2 * ng) * d, *tail)


def split_qkv(qkv: Any, nh: int, ng: int, d: int) -> tuple[Any, Any, Any]:
    """Inverse of interleave_qkv."""
    r = nh // ng
    tail = qkv.shape[1:]
    grouped = qkv.reshape(ng, (r + 2) * d, *tail)
    q, k, v = grouped.split([r * d, d, d], dim=1)
    return q.reshape(nh * d, *tail), k.reshape(ng * d, *tail), v.reshape(ng * d, *tail)


class Qwen2(Architecture):
    model_types = ("qwen2",)
    #: the fused QKV's tensors (Qwen2 has query/key/value biases)
    qkv_kinds: tuple[str, ...] = ("weight", "bias")

    def slime_model_flags(self, cfg: Mapping[str, Any], rotary_base: float) -> list[str]:
        self.validate(cfg)  # what the mapping refuses (a rope scaling it has no flags for, say) slime must not run
        args = [
            "--swiglu", "--num-layers", str(cfg["num_hidden_layers"]), "--hidden-size", str(cfg["hidden_size"]),
            "--ffn-hidden-size", str(cfg["intermediate_size"]), "--num-attention-heads", str(cfg["num_attention_heads"]),
            "--use-rotary-position-embeddings", "--disable-bias-linear",
            "--normalization", "RMSNorm", "--norm-epsilon", repr(float(cfg["rms_norm_eps"])),
            "--rotary-base", flag_number(rotary_base), "--vocab-size", str(cfg["vocab_size"]),
        ]
        if "bias" in self.qkv_kinds:
            args.append("--add-qkv-bias")
        args += self.slime_rope_flags(cfg)
        kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
        if kv != cfg["num_attention_heads"]:
            args += ["--group-query-attention", "--num-query-groups", str(kv)]
        if not cfg.get("tie_word_embeddings", False):
            args.append("--untie-embeddings-and-output-weights")
        return args

    def slime_rope_flags(self, cfg: Mapping[str, Any]) -> list[str]:
        """Flags of a rope variant (none: Qwen2's plain rope; validate refuses a scaling)."""
        return []

    def validate(self, cfg: Mapping[str, Any]) -> None:
        nh, ng, d = _shape(cfg)
        checks = [
            (cfg.get("hidden_act", "silu") == "silu", f"hidden_act={cfg.get('hidden_act')!r} (only silu)"),
            (not cfg.get("use_sliding_window", False), "use_sliding_window=true (sliding-window attention)"),
            (nh % ng == 0, f"num_attention_heads={nh} not a multiple of num_key_value_heads={ng}"),
            (all(t == "full_attention" for t in cfg.get("layer_types") or []), "layer_types other than full_attention"),
        ]
        refuse_unsupported(cfg, checks)

    def transformer_config(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        import torch

        nh, ng, d = _shape(cfg)
        return dict(
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=int(cfg["hidden_size"]),
            ffn_hidden_size=int(cfg["intermediate_size"]),
            num_attention_heads=nh,
            num_query_groups=ng,
            kv_channels=d,
            normalization="RMSNorm",
            layernorm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            add_bias_linear=False,
            add_qkv_bias=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            init_method_std=float(cfg.get("initializer_range", 0.02)),
            rotary_interleaved=False,
        )

    def gpt_model_kwargs(self, cfg: Mapping[str, Any], padded_vocab_size: int) -> dict[str, Any]:
        return dict(
            vocab_size=padded_vocab_size,
            max_sequence_length=int(cfg.get("max_position_embeddings", 32768)),
            share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)),
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=rope_theta_of(cfg),
        )

    def hf_to_megatron(self, hf: Mapping[str, Any], cfg: Mapping[str, Any], padded_vocab_size: int) -> dict[str, Any]:
        import torch

        nh, ng, d = _shape(cfg)
        tied = bool(cfg.get("tie_word_embeddings", False))
        src = {k: v for k, v in hf.items() if not _IGNORED.search(k)}
        tensors = HfTensors(src, cfg, padded_vocab_size)
        take, pad_rows = tensors.take, tensors.pad_rows

        out: dict[str, Any] = {"embedding.word_embeddings.weight": pad_rows(take("model.embed_tokens.weight"))}
        for i in range(int(cfg["num_hidden_layers"])):
            h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
            for hs, ms in _DIRECT.items():
                out[m + ms] = take(h + hs)
            for kind in self.qkv_kinds:
                q, k, v = (take(f"{h}self_attn.{p}_proj.{kind}") for p in "qkv")
                out[f"{m}self_attention.linear_qkv.{kind}"] = interleave_qkv(q, k, v, nh, ng, d)
            gate, up = take(h + "mlp.gate_proj.weight"), take(h + "mlp.up_proj.weight")
            out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        out["decoder.final_layernorm.weight"] = take("model.norm.weight")
        out.update(tensors.output_layer(tied))
        tensors.check_all_used()
        return out

    def megatron_to_hf(self, mg: Mapping[str, Any], cfg: Mapping[str, Any]) -> dict[str, Any]:
        nh, ng, d = _shape(cfg)
        vocab = int(cfg["vocab_size"])
        ffn = int(cfg["intermediate_size"])
        out: dict[str, Any] = {"model.embed_tokens.weight": mg["embedding.word_embeddings.weight"][:vocab]}
        for i in range(int(cfg["num_hidden_layers"])):
            h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
            for hs, ms in _DIRECT.items():
                out[h + hs] = mg[m + ms]
            for kind in self.qkv_kinds:
                q, k, v = split_qkv(mg[f"{m}self_attention.linear_qkv.{kind}"], nh, ng, d)
                out.update({f"{h}self_attn.q_proj.{kind}": q, f"{h}self_attn.k_proj.{kind}": k,
                            f"{h}self_attn.v_proj.{kind}": v})
            fc1 = mg[m + "mlp.linear_fc1.weight"]
            out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = fc1[:ffn], fc1[ffn:]
        out["model.norm.weight"] = mg["decoder.final_layernorm.weight"]
        if not cfg.get("tie_word_embeddings", False):
            out["lm_head.weight"] = mg["output_layer.weight"][:vocab]
        return {k: v.contiguous() for k, v in out.items()}
