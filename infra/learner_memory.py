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

from collections.abc import Mapping
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
    if any(k in cfg for k in ("num_experts", "num_local_experts", "layer_types")):
        return None  # mixture-of-experts or hybrid layers: not this formula
    kv = int(cfg.get("num_key_value_heads") or heads)
    d = int(cfg.get("head_dim") or h // heads)
    attn = h * heads * d + 2 * h * kv * d + heads * d * h + (heads + 2 * kv) * d  # qkv (with bias), out
    per_layer = attn + 3 * h * ffn + 2 * h
    embeddings = vocab * h * (1 if cfg.get("tie_word_embeddings", False) else 2)
    return embeddings + layers * per_layer + h


def tokens_per_micro_batch(train: Any, max_new_tokens: int) -> int:
    """Padded tokens in one learner micro-batch: the token budget, or rows x a nominal sequence."""
    if train.max_tokens_per_gpu is not None:
        return int(train.max_tokens_per_gpu)
    return int(train.micro_batch_size) * (NOMINAL_PROMPT + int(max_new_tokens))


def _activation_bytes_per_token(cfg: Mapping[str, Any]) -> float:
    return ACTIVATION_BYTES * int(cfg["num_hidden_layers"]) * int(cfg["hidden_size"])


def learner_peak_gib(cfg: Mapping[str, Any], train: Any, max_new_tokens: int) -> float | None:
    """Estimated peak GiB on each GPU of the tensor-parallel group; None when the shape is not dense."""
    params = dense_params(cfg)
    if params is None:
        return None
    tokens = tokens_per_micro_batch(train, max_new_tokens)
    total = params * BYTES_PER_PARAM + tokens * _activation_bytes_per_token(cfg) + LOGITS_BYTES
    return total / max(1, int(train.tensor_parallel)) / GIB


def tokens_that_fit(cfg: Mapping[str, Any], train: Any, gpu_gib: float) -> int:
    """The largest token budget (a multiple of 1024, at least 0) the estimate fits in `gpu_gib`."""
    params = dense_params(cfg) or 0
    room = USABLE * gpu_gib * GIB * max(1, int(train.tensor_parallel)) - params * BYTES_PER_PARAM - LOGITS_BYTES
    return max(0, int(room / _activation_bytes_per_token(cfg)) // 1024 * 1024)
