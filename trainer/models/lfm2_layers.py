"""LFM2's megatron-core building blocks: the gated short convolution, a router whose expert bias is a
frozen weight, and the per-layer block spec (conv or GQA attention; dense SwiGLU or sigmoid-routed MoE whose
experts run on grouped GEMMs, lfm2_experts.py; linears that add dW into weight.main_grad, fused_linear.py).
More in docs/extending.md (module notes).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.models.gpt import gpt_layer_specs as specs
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe import moe_utils as _moe_utils
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)

from .fused_linear import linear_classes
from .lfm2_experts import GroupedExperts

# megatron-core 0.16.1 (moe_utils.py) binds `te_general_gemm` only when Transformer Engine imports, then
# tests it for None in the router's gating GEMM: without TE every MoE forward raises NameError. Bind it to
# None (the value the code expects for "no TE"); drop this once the upstream import sets it.
if not hasattr(_moe_utils, "te_general_gemm"):
    _moe_utils.te_general_gemm = None


def _chunked_factory(sh_ten: ShardedTensor, sharded_offsets: tuple, parts: int) -> ShardedTensorFactory:
    """Save a column-parallel weight made of `parts` concatenated blocks as `parts` TP-sharded blocks,
    so the global tensor is the blocks laid end to end whatever the TP size (cf. megatron's SwiGLU fc1)."""
    prepend = len(sharded_offsets)
    local = sh_ten.local_shape[0]
    rank_offset = sh_ten.global_offset[prepend] // local
    frag = sh_ten.axis_fragmentations[prepend]

    @torch.no_grad()
    def build(key, t, replica_id, flattened_range):
        return [
            ShardedTensor.from_rank_offsets(key, piece, *sharded_offsets, (prepend, rank_offset + j * frag, frag * parts),
                                            replica_id=replica_id, prepend_axis_num=prepend)
            for j, piece in enumerate(torch.chunk(t, parts, dim=0))
        ]

    def merge(pieces):
        with torch.no_grad():
            return torch.cat(pieces)

    return ShardedTensorFactory(sh_ten.key, sh_ten.data, build, merge, sh_ten.replica_id,
                                flattened_range=sh_ten.flattened_range)


class Lfm2ShortConv(MegatronModule):
    """LFM2's input-gated short convolution, in megatron's self-attention slot."""

    def __init__(self, config, layer_number: int, kernel_size: int = 3, pg_collection=None, **_: Any):
        super().__init__(config=config)
        if config.sequence_parallel or config.context_parallel_size > 1:
            raise ValueError("LFM2 conv layers need the whole sequence on each rank: turn off "
                             "sequence_parallel and use context_parallel_size=1")
        tp = parallel_state.get_tensor_model_parallel_world_size()
        h = config.hidden_size
        if h % tp:
            raise ValueError(f"hidden_size={h} is not divisible by tensor_parallel={tp}")
        self.layer_number, self.kernel_size = layer_number, kernel_size
        column, row = linear_classes()  # megatron's, adding dW into weight.main_grad where the learner sets it
        self.in_proj = column(
            h, 3 * h, config=config, init_method=config.init_method, bias=False, gather_output=False,
            stride=3, skip_bias_add=True)
        self.out_proj = row(
            h, h, config=config, init_method=config.output_layer_init_method, bias=False,
            input_is_parallel=True, skip_bias_add=True)
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.conv_weight = torch.nn.Parameter(torch.empty(h // tp, 1, kernel_size, dtype=config.params_dtype, device=device))
        if config.perform_initialization:
            config.init_method(self.conv_weight)
        tensor_parallel.set_tensor_model_parallel_attributes(self.conv_weight, True, 0, 1)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, inference_context=None, **_: Any):
        if inference_context is not None:
            raise NotImplementedError("Lfm2ShortConv: cached inference is the workers' job, not the learner's")
        s = hidden_states.shape[0]
        bcx, _ = self.in_proj(hidden_states)              # [s, b, 3h/tp]
        b, c, x = bcx.chunk(3, dim=-1)
        bx = (b * x).permute(1, 2, 0)                     # [b, h/tp, s]
        w = self.conv_weight
        conv = F.conv1d(bx.to(w.dtype), w, padding=self.kernel_size - 1, groups=w.shape[0])[..., :s]
        y = c * conv.permute(2, 0, 1).to(c.dtype)         # [s, b, h/tp]
        return self.out_proj(y)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        sd.update(make_sharded_tensors_for_checkpoint(
            {"conv_weight": self.conv_weight}, prefix, {"conv_weight": 0}, sharded_offsets,
            tp_group=parallel_state.get_tensor_model_parallel_group(), dp_cp_group=metadata["dp_cp_group"]))
        key = f"{prefix}in_proj.weight"
        sd[key] = _chunked_factory(sd[key], sharded_offsets, 3)
        return sd


class FrozenBiasRouter(TopKRouter):
    """TopKRouter whose expert bias is a frozen parameter: it loads and saves with the weights (HF keeps it
    in the checkpoint), and RL fine-tuning never moves it (bias_update_rate is 0 in the config). Under
    routing replay (trainer/models/routing_replay.py) it routes to the recorded experts."""

    #: (Replayer, this router's MoE layer position), set by `Replayer.megatron`
    replay_source: tuple[Any, int] | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.expert_bias is not None:
            bias = self._buffers.pop("expert_bias")
            self.expert_bias = torch.nn.Parameter(bias, requires_grad=False)

    def routing(self, logits: torch.Tensor, *args: Any, **kwargs: Any):
        """megatron's routing; with recorded routes in hand, through its replay entry (MegatronReplay)."""
        from .routing_replay import MegatronReplay

        src = self.replay_source
        recorded = None if src is None else src[0].layer(src[1])
        if recorded is None:
            return super().routing(logits, *args, **kwargs)
        if self.config.moe_router_fusion:  # the fused top-k takes no replay
            raise ValueError("algo.routing_replay needs moe_router_fusion off (the fused top-k cannot replay)")
        own, self.router_replay = self.router_replay, MegatronReplay(recorded)
        try:
            return super().routing(logits, *args, **kwargs)
        finally:
            self.router_replay = own


def _replace(spec: Any, **changes: Any) -> Any:
    """A copy of a megatron spec with some submodules replaced. megatron-core <= 0.18 gives ModuleSpecs;
    0.19 gives builders, `partial(Module, submodules=...)`: both carry the same submodules dataclass."""
    if isinstance(spec, functools.partial):
        subs = dataclasses.replace(spec.keywords["submodules"], **changes)
        return functools.partial(spec.func, *spec.args, **{**spec.keywords, "submodules": subs})
    return ModuleSpec(module=spec.module, params=dict(spec.params or {}),
                      submodules=dataclasses.replace(spec.submodules, **changes))


def _with_module(spec: Any, module: type) -> Any:
    if isinstance(spec, functools.partial):
        return functools.partial(module, *spec.args, **spec.keywords)
    return ModuleSpec(module=module, params=dict(spec.params or {}), submodules=spec.submodules)


def _moe_spec(mlp: Any, router: type) -> Any:
    """The MoE feed-forward spec with our router and our grouped-GEMM experts (their linears add dW into
    weight.main_grad where the learner sets it, as the loop's would)."""
    column, row = linear_classes()
    subs = mlp.keywords["submodules"] if isinstance(mlp, functools.partial) else mlp.submodules
    experts = _replace(_with_module(subs.experts, GroupedExperts), linear_fc1=column, linear_fc2=row)
    return _replace(mlp, router=router, experts=experts)


def _dense_spec(mlp: Any) -> Any:
    column, row = linear_classes()
    return _replace(mlp, linear_fc1=column, linear_fc2=row)


def block_spec(layer_types: list[str], num_dense_layers: int, num_experts: int | None, kernel_size: int,
               core_attention: Any = None) -> TransformerBlockSubmodules:
    """One TransformerLayer spec per layer: conv or attention operator, dense or MoE feed-forward."""
    dense = specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True)
    moe = specs.get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                         normalization="RMSNorm", qk_layernorm=True) if num_experts else None
    layers = []
    for i, kind in enumerate(layer_types):
        base = dense if (moe is None or i < num_dense_layers) else moe
        sub = base.submodules
        mlp = _moe_spec(sub.mlp, FrozenBiasRouter) if base is moe else _dense_spec(sub.mlp)
        if kind == "conv":
            operator = ModuleSpec(module=Lfm2ShortConv, params={"kernel_size": kernel_size})
            keys = {"pre_mlp_layernorm.": sub.sharded_state_dict_keys_map.get("pre_mlp_layernorm.", "pre_mlp_layernorm.")}
        else:
            operator = sub.self_attention
            column, row = linear_classes()
            attn = {"linear_qkv": column, "linear_proj": row}
            if core_attention is not None:
                attn["core_attention"] = core_attention
            operator = ModuleSpec(module=operator.module, params=dict(operator.params or {}),
                                  submodules=type(operator.submodules)(**{**vars(operator.submodules), **attn}))
            keys = dict(sub.sharded_state_dict_keys_map)
        layer_sub = type(sub)(**{**vars(sub), "self_attention": operator, "mlp": mlp, "sharded_state_dict_keys_map": keys})
        layers.append(ModuleSpec(module=base.module, submodules=layer_sub))
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=dense.submodules.input_layernorm)
