"""LFM2 / LFM2-MoE (LFM2.5-8B-A1B) <-> megatron-core. Parity with transformers' own classes is tested in
tests/test_lfm2_megatron.py; the modules are in lfm2_layers.py.
More in docs/extending.md (module notes).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any

from .arch import Architecture, HfTensors, flag_number
from .hf_io import refuse_unsupported, rope_theta_of
from .qwen2 import interleave_qkv, split_qkv

_IGNORED = re.compile(r"(^|\.)(pos_emb|rotary_emb)\.(original_)?inv_freq$")


def layer_types(cfg: Mapping[str, Any]) -> list[str]:
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        idx = cfg.get("full_attn_idxs")
        idx = set(range(n)) if idx is None else set(idx)
        types = ["full_attention" if i in idx else "conv" for i in range(n)]
    return list(types)


def dense_ffn(cfg: Mapping[str, Any]) -> int:
    """Width of the dense SwiGLU: LFM2 (dense) may shrink intermediate_size like its HF class does."""
    ffn = int(cfg.get("intermediate_size") or cfg.get("block_ff_dim"))
    if cfg.get("model_type") == "lfm2" and cfg.get("block_auto_adjust_ff_dim", True):
        ffn = int(2 * ffn / 3)
        mult, multiple = cfg.get("block_ffn_dim_multiplier", 1.0), int(cfg.get("block_multiple_of", 256))
        if mult is not None:
            ffn = multiple * ((int(mult * ffn) + multiple - 1) // multiple)
    return ffn


def _moe(cfg: Mapping[str, Any]) -> bool:
    return cfg.get("model_type") == "lfm2_moe"


def _shape(cfg: Mapping[str, Any]) -> tuple[int, int, int]:
    nh = int(cfg["num_attention_heads"])
    ng = int(cfg.get("num_key_value_heads") or nh)
    return nh, ng, int(cfg.get("head_dim") or int(cfg["hidden_size"]) // nh)


#: slime's layer-spec hook for LFM2-MoE (trainer/models/lfm2_slime.py), passed as `--spec`
SLIME_SPEC = ["trainer.models.lfm2_slime", "lfm2_spec"]


class Lfm2(Architecture):
    model_types = ("lfm2", "lfm2_moe")

    def validate(self, cfg: Mapping[str, Any]) -> None:
        nh, ng, _ = _shape(cfg)
        types = layer_types(cfg)
        checks = [
            (len(types) == int(cfg["num_hidden_layers"]), f"{len(types)} layer_types for {cfg['num_hidden_layers']} layers"),
            (set(types) <= {"conv", "full_attention"}, f"layer_types {sorted(set(types))} (only conv, full_attention)"),
            (not cfg.get("conv_bias", False), "conv_bias=true (LFM2 releases have none)"),
            (nh % ng == 0, f"num_attention_heads={nh} not a multiple of num_key_value_heads={ng}"),
        ]
        if _moe(cfg):
            k = int(cfg.get("num_experts_per_tok", 4))
            checks.append((cfg.get("norm_topk_prob", True) or k == 1,
                           "norm_topk_prob=false (megatron's sigmoid router always renormalises the top-k)"))
        refuse_unsupported(cfg, checks)

    def transformer_config(self, cfg: Mapping[str, Any]) -> dict[str, Any]:
        import torch

        nh, ng, d = _shape(cfg)
        out = dict(
            num_layers=int(cfg["num_hidden_layers"]), hidden_size=int(cfg["hidden_size"]),
            ffn_hidden_size=dense_ffn(cfg), num_attention_heads=nh, num_query_groups=ng, kv_channels=d,
            normalization="RMSNorm", layernorm_epsilon=float(cfg.get("norm_eps", 1e-5)),
            gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
            add_qkv_bias=False, qk_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0,
            init_method_std=float(cfg.get("initializer_range", 0.02)), rotary_interleaved=False,
            hetereogenous_dist_checkpoint=True,  # conv and attention layers have different tensors
        )
        if _moe(cfg):
            dense = int(cfg.get("num_dense_layers", 2))
            scale = float(cfg.get("routed_scaling_factor", 1.0))
            out.update(
                num_moe_experts=int(cfg["num_experts"]), moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
                moe_router_topk=int(cfg["num_experts_per_tok"]), moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=bool(cfg.get("use_expert_bias", True)),
                moe_router_bias_update_rate=0.0, moe_router_topk_scaling_factor=None if scale == 1.0 else scale,
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False,
                # alltoall is megatron's dispatcher for expert parallelism; it needs CUDA streams, so a
                # CPU build (CI, conversion) uses allgather: same routing, same numbers
                moe_token_dispatcher_type="alltoall" if torch.cuda.is_available() else "allgather",
                moe_layer_freq=[0] * dense + [1] * (int(cfg["num_hidden_layers"]) - dense),
            )
        return out

    def gpt_model_kwargs(self, cfg: Mapping[str, Any], padded_vocab_size: int) -> dict[str, Any]:
        return dict(vocab_size=padded_vocab_size, max_sequence_length=int(cfg.get("max_position_embeddings", 128000)),
                    share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", True)),
                    position_embedding_type="rope", rotary_percent=1.0, rotary_base=rope_theta_of(cfg))

    def slime_model_flags(self, cfg: Mapping[str, Any], rotary_base: float) -> list[str]:
        """Megatron-LM flags of an lfm2_moe config.json (the TransformerConfig this class builds), with our
        layer-spec hook as `--spec`; dense LFM2 runs on the native engine only."""
        if cfg.get("model_type") != "lfm2_moe":
            return super().slime_model_flags(cfg, rotary_base)
        c = cfg
        self.validate(c)
        n, dense = int(c["num_hidden_layers"]), int(c.get("num_dense_layers", 2))
        heads, kv = int(c["num_attention_heads"]), int(c.get("num_key_value_heads") or c["num_attention_heads"])
        args = [
            "--spec", *SLIME_SPEC, "--swiglu", "--disable-bias-linear", "--qk-layernorm",
            "--num-layers", str(n), "--hidden-size", str(c["hidden_size"]), "--ffn-hidden-size", str(dense_ffn(c)),
            "--num-attention-heads", str(heads), "--use-rotary-position-embeddings",
            "--rotary-base", flag_number(rotary_base),
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

    def layer_spec(self, cfg: Mapping[str, Any], attention: str = "auto") -> Any:
        """Per-layer block spec. Attention runs through torch SDPA (or megatron's unfused local attention
        with attention='local'); the Transformer Engine spec is not used for LFM2's mixed layers."""
        from .layer_specs import sdpa_attention_class
        from .lfm2_layers import block_spec

        if attention not in ("auto", "te", "sdpa", "local"):
            raise ValueError(f"attention={attention!r}; choose one of auto, sdpa, local")
        core = None if attention == "local" else sdpa_attention_class()
        experts = int(cfg["num_experts"]) if _moe(cfg) else None
        dense = int(cfg.get("num_dense_layers", 2)) if _moe(cfg) else int(cfg["num_hidden_layers"])
        return block_spec(layer_types(cfg), dense, experts, int(cfg.get("conv_L_cache", 3)), core_attention=core)

    # ---- names ----------------------------------------------------------------------------------------
    def _is_moe_layer(self, cfg: Mapping[str, Any], i: int) -> bool:
        return _moe(cfg) and i >= int(cfg.get("num_dense_layers", 2))

    def hf_to_megatron(self, hf: Mapping[str, Any], cfg: Mapping[str, Any], padded_vocab_size: int) -> dict[str, Any]:
        import torch

        nh, ng, d = _shape(cfg)
        src = {k: v for k, v in hf.items() if not _IGNORED.search(k)}
        tensors = HfTensors(src, cfg, padded_vocab_size)
        take, pad_rows = tensors.take, tensors.pad_rows

        out: dict[str, Any] = {"embedding.word_embeddings.weight": pad_rows(take("model.embed_tokens.weight")),
                               "decoder.final_layernorm.weight": take("model.embedding_norm.weight")}
        for i, kind in enumerate(layer_types(cfg)):
            h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
            out[m + "input_layernorm.weight"] = take(h + "operator_norm.weight")
            out[m + "pre_mlp_layernorm.weight"] = take(h + "ffn_norm.weight")
            if kind == "conv":
                out[m + "self_attention.in_proj.weight"] = take(h + "conv.in_proj.weight")
                out[m + "self_attention.out_proj.weight"] = take(h + "conv.out_proj.weight")
                out[m + "self_attention.conv_weight"] = take(h + "conv.conv.weight")
            else:
                q, k, v = (take(f"{h}self_attn.{p}_proj.weight") for p in "qkv")
                out[m + "self_attention.linear_qkv.weight"] = interleave_qkv(q, k, v, nh, ng, d)
                out[m + "self_attention.linear_proj.weight"] = take(h + "self_attn.out_proj.weight")
                out[m + "self_attention.q_layernorm.weight"] = take(h + "self_attn.q_layernorm.weight")
                out[m + "self_attention.k_layernorm.weight"] = take(h + "self_attn.k_layernorm.weight")
            f = h + "feed_forward."
            if not self._is_moe_layer(cfg, i):
                out[m + "mlp.linear_fc1.weight"] = torch.cat([take(f + "w1.weight"), take(f + "w3.weight")])
                out[m + "mlp.linear_fc2.weight"] = take(f + "w2.weight")
                continue
            out[m + "mlp.router.weight"] = take(f + "gate.weight")
            if cfg.get("use_expert_bias", True):
                out[m + "mlp.router.expert_bias"] = take(f + "expert_bias").float()
            for e in range(int(cfg["num_experts"])):
                x = f"{m}mlp.experts.local_experts.{e}."
                if f + "experts.gate_up_proj" in src:  # transformers' fused in-memory form
                    out[x + "linear_fc1.weight"] = take(f + "experts.gate_up_proj")[e]
                    out[x + "linear_fc2.weight"] = take(f + "experts.down_proj")[e]
                else:
                    g = f"{f}experts.{e}."
                    out[x + "linear_fc1.weight"] = torch.cat([take(g + "w1.weight"), take(g + "w3.weight")])
                    out[x + "linear_fc2.weight"] = take(g + "w2.weight")
        out.update(tensors.output_layer(bool(cfg.get("tie_word_embeddings", True))))
        tensors.check_all_used()
        return out

    def runtime_layout(self, hf: dict[str, Any], cfg: Mapping[str, Any]) -> dict[str, Any]:
        """Per-expert w1/w3/w2 stacked into experts.gate_up_proj [E, 2I, h] and experts.down_proj [E, h, I]
        where the installed transformers holds LFM2-MoE's experts fused (transformers 5)."""
        if not _moe(cfg) or not transformers_fuses_experts():
            return hf
        import torch

        out = dict(hf)
        for i in range(int(cfg["num_hidden_layers"])):
            if not self._is_moe_layer(cfg, i):
                continue
            f = f"model.layers.{i}.feed_forward.experts."
            names = [[f"{f}{e}.{w}.weight" for w in ("w1", "w3", "w2")] for e in range(int(cfg["num_experts"]))]
            out[f + "gate_up_proj"] = torch.stack([torch.cat([out.pop(w1), out.pop(w3)]) for w1, w3, _ in names])
            out[f + "down_proj"] = torch.stack([out.pop(w2) for _, _, w2 in names])
        return out

    def megatron_to_hf(self, mg: Mapping[str, Any], cfg: Mapping[str, Any]) -> dict[str, Any]:
        nh, ng, d = _shape(cfg)
        vocab = int(cfg["vocab_size"])
        out: dict[str, Any] = {"model.embed_tokens.weight": mg["embedding.word_embeddings.weight"][:vocab],
                               "model.embedding_norm.weight": mg["decoder.final_layernorm.weight"]}
        for i, kind in enumerate(layer_types(cfg)):
            h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
            out[h + "operator_norm.weight"] = mg[m + "input_layernorm.weight"]
            out[h + "ffn_norm.weight"] = mg[m + "pre_mlp_layernorm.weight"]
            if kind == "conv":
                out[h + "conv.in_proj.weight"] = mg[m + "self_attention.in_proj.weight"]
                out[h + "conv.out_proj.weight"] = mg[m + "self_attention.out_proj.weight"]
                out[h + "conv.conv.weight"] = mg[m + "self_attention.conv_weight"]
            else:
                q, k, v = split_qkv(mg[m + "self_attention.linear_qkv.weight"], nh, ng, d)
                out.update({h + "self_attn.q_proj.weight": q, h + "self_attn.k_proj.weight": k,
                            h + "self_attn.v_proj.weight": v})
                out[h + "self_attn.out_proj.weight"] = mg[m + "self_attention.linear_proj.weight"]
                out[h + "self_attn.q_layernorm.weight"] = mg[m + "self_attention.q_layernorm.weight"]
                out[h + "self_attn.k_layernorm.weight"] = mg[m + "self_attention.k_layernorm.weight"]
            f = h + "feed_forward."
            if not self._is_moe_layer(cfg, i):
                fc1 = mg[m + "mlp.linear_fc1.weight"]
                out[f + "w1.weight"], out[f + "w3.weight"] = fc1.chunk(2)
                out[f + "w2.weight"] = mg[m + "mlp.linear_fc2.weight"]
                continue
            out[f + "gate.weight"] = mg[m + "mlp.router.weight"]
            if cfg.get("use_expert_bias", True):
                out[f + "expert_bias"] = mg[m + "mlp.router.expert_bias"].float()
            for e in range(int(cfg["num_experts"])):
                x, g = f"{m}mlp.experts.local_experts.{e}.", f"{f}experts.{e}."
                out[g + "w1.weight"], out[g + "w3.weight"] = mg[x + "linear_fc1.weight"].chunk(2)
                out[g + "w2.weight"] = mg[x + "linear_fc2.weight"]
        if not cfg.get("tie_word_embeddings", True):
            out["lm_head.weight"] = mg["output_layer.weight"][:vocab]
        return {k: v.contiguous() for k, v in out.items()}


@functools.lru_cache(maxsize=1)
def transformers_fuses_experts() -> bool:
    """Whether the installed transformers holds LFM2-MoE's experts fused in memory (experts.gate_up_proj and
    experts.down_proj, one tensor per projection) rather than per expert: asked of a tiny model on the meta device."""
    try:
        import torch
        from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM
    except ImportError:
        return False
    cfg = Lfm2MoeConfig(vocab_size=8, hidden_size=8, intermediate_size=8, moe_intermediate_size=8, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, num_dense_layers=1, num_experts=2,
                        num_experts_per_tok=1, layer_types=["conv", "full_attention"])
    with torch.device("meta"):
        names = Lfm2MoeForCausalLM(cfg).state_dict().keys()
    return any(n.endswith("experts.gate_up_proj") for n in names)
