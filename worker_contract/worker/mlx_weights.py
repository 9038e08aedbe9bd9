"""The run's plane tensors under mlx-lm's names and layouts: what the MLX worker loads, bit for bit.

Planes name tensors as HF checkpoints do (worker_contract/planes). mlx-lm's models use the same names
for Qwen2 and LFM2; where they differ this module maps them, the way each mlx-lm model's `sanitize` does
for a Hub checkpoint, except that it also carries int8g64's `.scales` and `.biases` (sanitize knows only
`.weight`). Nothing is converted: codes, scales, biases and bf16 values keep their bits; only names,
a transpose (LFM2's depthwise conv kernel) and a stack (LFM2-MoE's per-expert weights into mlx-lm's
SwitchGLU tensors) change. numpy in, numpy out, so the mapping is testable without mlx.
More in docs/mac-worker.md (module notes).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

#: config.json architecture -> mlx-lm model module (mlx_lm.models.<name>)
MLX_MODELS = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama", "Lfm2ForCausalLM": "lfm2", "Lfm2MoeForCausalLM": "lfm2_moe"}
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT = re.compile(r"(model\.layers\.\d+\.feed_forward\.)experts\.(\d+)\.(w[123])\.(weight|scales|biases)")
_FUSED = re.compile(r"(model\.layers\.\d+\.feed_forward\.)experts\.(gate_up_proj|down_proj)")
_DENSE_FF = re.compile(r"(model\.layers\.\d+\.feed_forward\.)(w[123])\.(weight|scales|biases)")


def mlx_model_name(architecture: str) -> str:
    """The mlx-lm model of an HF architecture; ValueError naming the supported ones otherwise."""
    try:
        return MLX_MODELS[architecture]
    except KeyError:
        raise ValueError(f"the MLX worker runs {', '.join(sorted(MLX_MODELS))}; this run's model is "
                         f"{architecture}") from None


def to_mlx(architecture: str, state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF-named plane tensors -> mlx-lm names and layouts, values unchanged."""
    kind = mlx_model_name(architecture)
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[str, str, str], dict[int, np.ndarray]] = {}
    for name, a in state.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if kind not in ("qwen2", "llama") and name.endswith("conv.conv.weight") and a.ndim == 3 and a.shape[1] == 1:
            a = np.ascontiguousarray(a.transpose(0, 2, 1))  # torch Conv1d [out, in/groups, L] -> mlx [out, L, in]
        if kind == "lfm2_moe":
            if m := _EXPERT.fullmatch(name):
                experts.setdefault((m[1], _PROJ[m[3]], m[4]), {})[int(m[2])] = a
                continue
            if m := _FUSED.fullmatch(name):  # transformers' in-memory form: gate_up [E, 2I, h], down [E, h, I]
                if m[2] == "down_proj":
                    out[f"{m[1]}switch_mlp.down_proj.weight"] = a
                else:
                    half = a.shape[1] // 2
                    out[f"{m[1]}switch_mlp.gate_proj.weight"] = np.ascontiguousarray(a[:, :half])
                    out[f"{m[1]}switch_mlp.up_proj.weight"] = np.ascontiguousarray(a[:, half:])
                continue
            if m := _DENSE_FF.fullmatch(name):
                name = f"{m[1]}{_PROJ[m[2]]}.{m[3]}"
        out[name] = a
    for (prefix, proj, suffix), per in experts.items():
        if sorted(per) != list(range(len(per))):
            raise ValueError(f"{prefix}experts: expert indices {sorted(per)} are not 0..{len(per) - 1}")
        out[f"{prefix}switch_mlp.{proj}.{suffix}"] = np.stack([per[e] for e in range(len(per))])
    return out


def quantized_modules(mlx_state: Mapping[str, np.ndarray]) -> set[str]:
    """mlx-lm module paths that the plane quantized (those with `.scales`), as mlx-lm's loader decides."""
    return {k[: -len(".scales")] for k in mlx_state if k.endswith(".scales")}



def mlx_targets(architecture: str, name: str, shape: tuple[int, ...], idx: np.ndarray
                ) -> list[tuple[str, int, np.ndarray, np.ndarray]] | None:
    """Where the elements `idx` (flat) of an HF-named plane tensor live in the mlx-lm model: a list of
    (mlx-lm name, start, flat positions there counted from start, the source positions they take), or None
    where the mapping reorders values (a transposed conv kernel: rewritten whole). RoPE's inv_freq lives
    nowhere: []. `start` spares an offset array per tensor: an expert's slab is a view of the stack."""
    kind = mlx_model_name(architecture)
    if name.endswith("rotary_emb.inv_freq"):
        return []
    if kind not in ("qwen2", "llama") and name.endswith("conv.conv.weight") and len(shape) == 3 and shape[1] == 1:
        return None
    if kind == "lfm2_moe":
        if m := _EXPERT.fullmatch(name):  # expert e is slab e of the stacked tensor
            return [(f"{m[1]}switch_mlp.{_PROJ[m[3]]}.{m[4]}", int(m[2]) * int(np.prod(shape)), idx, idx)]
        if m := _FUSED.fullmatch(name):
            if m[2] == "down_proj":
                return [(f"{m[1]}switch_mlp.down_proj.weight", 0, idx, idx)]
            experts, rows, width = shape  # gate_up [E, 2I, h]: rows < I are gate's, the rest up's
            half = rows // 2
            e, r, c = idx // (rows * width), (idx // width) % rows, idx % width
            up = r >= half
            at = e * half * width + (r - half * up) * width + c
            return [(f"{m[1]}switch_mlp.gate_proj.weight", 0, at[~up], idx[~up]),
                    (f"{m[1]}switch_mlp.up_proj.weight", 0, at[up], idx[up])]
        if m := _DENSE_FF.fullmatch(name):
            return [(f"{m[1]}{_PROJ[m[2]]}.{m[3]}", 0, idx, idx)]
    return [(name, 0, idx, idx)]
