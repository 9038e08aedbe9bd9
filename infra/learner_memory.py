"""An estimate of the learner's peak GPU memory, for a recipe and a dense decoder's HF config.

Why: an out-of-memory error at the first learner step comes after the download, the conversion and the
launch; the preflight can warn before all that. The constants are fitted to the megatron backend's
measured peaks for a Qwen2.5-1.5B-shaped model on one H200 (docs/performance.md): 39.9 GiB at 4096
tokens per micro-batch and 66.5 GiB at 16384. They are 20 bytes per parameter (bf16 policy and
reference, float32 master weights, gradients and two Adam moments), about 54 bytes of activations per
token, layer and hidden unit, and the 2 GiB budget of one chunk of float32 logits. slime's learner
differs in its details, so the figure is a guide, not a promise.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from typing import Any

BYTES_PER_PARAM = 20
ACTIVATION_BYTES = 54  # per token x layer x hidden unit (fitted, see above)
LOGITS_BYTES = 2 << 30
#: prompt tokens assumed per row when micro-batches are counted in rows
NOMINAL_PROMPT = 512
#: the share of the GPU's memory the estimate may use (the CUDA context and fragmentation take the rest)
USABLE = 0.95
GIB = 2**30


def dense_params(cfg: Mapping[str, Any]) -> int | None:
    """Parameters of a dense decoder (Llama / Qwen2 layout) from its HF config; None for other shapes."""
    try:
        h, layers, ffn = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["intermediate_size"])
        vocab, heads = int(cfg["vocab_size"]), int(cfg["num_attention_heads"])
    except (KeyError, TypeError, ValueError):
        return None
    if is_moe(cfg) or "layer_types" in cfg:
        return None  # mixture-of-experts or hybrid layers: not this formula
    kv = int(cfg.get("num_key_value_heads") or heads)
    d = int(cfg.get("head_dim") or h // heads)
    attn = h * heads * d + 2 * h * kv * d + heads * d * h + (heads + 2 * kv) * d  # qkv (with bias), out
    per_layer = attn + 3 * h * ffn + 2 * h
    embeddings = vocab * h * (1 if cfg.get("tie_word_embeddings", False) else 2)
    return embeddings + layers * per_layer + h


def tokens_per_micro_batch(compute: Any, max_new_tokens: int) -> int:
    """Padded tokens in one learner micro-batch (`compute`: the recipe's compute section): the token budget, or
    rows x a nominal sequence."""
    if compute.max_tokens_per_gpu is not None:
        return int(compute.max_tokens_per_gpu)
    return int(compute.micro_batch_size) * (NOMINAL_PROMPT + int(max_new_tokens))


def _activation_bytes_per_token(cfg: Mapping[str, Any], per_unit: float = ACTIVATION_BYTES) -> float:
    """Activation bytes of one token: `per_unit` bytes per layer and hidden unit."""
    return per_unit * int(cfg["num_hidden_layers"]) * int(cfg["hidden_size"])


def learner_peak_gib(cfg: Mapping[str, Any], compute: Any, max_new_tokens: int) -> float | None:
    """Estimated peak GiB on each GPU of the tensor-parallel group; None when the shape is not dense."""
    params = dense_params(cfg)
    if params is None:
        return None
    tokens = tokens_per_micro_batch(compute, max_new_tokens)
    total = params * BYTES_PER_PARAM + tokens * _activation_bytes_per_token(cfg) + LOGITS_BYTES
    return total / max(1, int(compute.tensor_parallel)) / GIB


def tokens_that_fit(cfg: Mapping[str, Any], compute: Any, gpu_gib: float) -> int:
    """The largest token budget (a multiple of 1024, at least 0) the estimate fits in `gpu_gib`."""
    params = dense_params(cfg) or 0
    room = USABLE * gpu_gib * GIB * max(1, int(compute.tensor_parallel)) - params * BYTES_PER_PARAM - LOGITS_BYTES
    return max(0, int(room / _activation_bytes_per_token(cfg)) // 1024 * 1024)


# -- mixture-of-experts models on the megatron backend, under the recipe's memory plan -------------------------
# Fitted to LFM2.5-8B-A1B's measured peaks on one H200 (17408 tokens per micro-batch): per token x layer x
# hidden unit, logits included, 54 bytes of activations without recompute (lfm2_step_h200_a038fb5_offload*.json,
# the experts' activation fused; 67 before it) and 24 with it (lfm2_step_h200_6b93c03.json, before the fusion).
# Per parameter the GPU always holds the bf16 policy and reference and the float32 gradient (8 bytes) and, while
# a version publishes during the next step, the bf16 snapshot it publishes from (2; trainer/publish/queue.py:
# not in the bench's step, so added here); the float32 master (4) and the two moments (2 x 2 or 2 x 4) stay
# there unless offloaded.
MOE_ACTIVATION_BYTES = {False: 54, True: 24}
MOE_RESIDENT_BYTES = 8 + 2  # per parameter, never offloaded
#: the plans tried for a card, fastest first as measured (11.7 s offload 0.75, 12.2 s offload 1.0, 15.9 s
#: offload 0.5 + recompute, 17.1 s offload 1.0 + recompute): (optimizer_offload, gradient_checkpointing), bf16
#: moments throughout; less offload than measured is assumed no slower
MOE_PLANS = ((0.0, False), (0.5, False), (0.75, False), (1.0, False), (1.0, True))
#: the cards users rent, in GiB as nvidia-smi reports them (80 GB H100/A100, 141 GB H200, 180 GB B200)
CARDS = {"80 GB": 79.6, "141 GB": 139.8, "180 GB": 178.4}


def total_params(cfg: Mapping[str, Any]) -> int | None:
    """Parameters of any architecture transformers knows, counted on the meta device (no memory, no download)."""
    return _total_params(json.dumps(dict(cfg), sort_keys=True))


@functools.lru_cache(maxsize=8)
def _total_params(cfg_json: str) -> int | None:
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.for_model(**json.loads(cfg_json))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # an unknown model_type or an incomplete config: no estimate, said by the caller
        return None
    return sum(p.numel() for p in model.parameters())


def is_moe(cfg: Mapping[str, Any]) -> bool:
    return any(k in cfg for k in ("num_experts", "num_local_experts"))


def moe_peak_gib(cfg: Mapping[str, Any], params: int, tokens: int, *, offload: float, recompute: bool,
                 moment_bytes: int = 2, tp: int = 1) -> float:
    """Estimated peak GiB per GPU of a mixture-of-experts model under a memory plan (constants above)."""
    state = params * (MOE_RESIDENT_BYTES + (1 - offload) * (4 + 2 * moment_bytes))
    act = tokens * _activation_bytes_per_token(cfg, MOE_ACTIVATION_BYTES[recompute])
    return (state + act) / max(1, tp) / GIB


def moe_plan_for(cfg: Mapping[str, Any], params: int, tokens: int, gpu_gib: float, tp: int = 1,
                 moment_bytes: Callable[[float], int] = lambda _offload: 2):
    """The fastest plan of MOE_PLANS that fits `gpu_gib` (with its estimate), or None. `moment_bytes(offload)`:
    the bytes of each Adam moment the engine keeps under that plan (infra.slime_launch.moment_bytes)."""
    for offload, recompute in MOE_PLANS:
        est = moe_peak_gib(cfg, params, tokens, offload=offload, recompute=recompute, tp=tp,
                           moment_bytes=moment_bytes(offload))
        if est <= USABLE * gpu_gib:
            return offload, recompute, est
    return None


def moe_tokens_that_fit(cfg: Mapping[str, Any], params: int, gpu_gib: float, tp: int = 1) -> int:
    """The largest token budget (a multiple of 1024) of the leanest plan (all offloaded, recompute) in `gpu_gib`."""
    room = USABLE * gpu_gib * GIB * max(1, tp) - params * MOE_RESIDENT_BYTES
    return max(0, int(room / _activation_bytes_per_token(cfg, MOE_ACTIVATION_BYTES[True])) // 1024 * 1024)


def describe_plan(offload: float, recompute: bool) -> str:
    return (f"optim.offload: {offload:g}, compute.gradient_checkpointing: {str(recompute).lower()}, "
            "optim.moment_dtype: bfloat16")
