"""What the MLX worker must hold, from the built model's shapes, and the refusal to start where it cannot.

    need = worker_memory(model, config, plane="int8g64", dtype="bfloat16", n_samples=8, max_new_tokens=4096)
    check_memory(need, total_bytes())       # ValueError (one sentence) where the machine is too small

The worker holds the model's weights, the reconstructor's copy of the published plane (it checks every
patch against it), the patch being applied (a new copy of each changed tensor while it is decoded: up to
the plane's size again), the KV cache of a batch of episodes, and a fixed overhead (Python, MLX, the
tokenizer). bench/worker_speed.py `memory` measures it at LFM2.5-8B-A1B shapes, layer-scaled.
"""

from __future__ import annotations

import os

#: Python, MLX, the tokenizer and the decoding activations (bench/results/worker_speed_memory.json)
OVERHEAD_BYTES = 1 << 30
#: prompt and tool tokens a psqa context holds beyond max_new_tokens (the question and instructions)
PROMPT_TOKENS = 512


def _params(model) -> list[tuple[str, tuple[int, ...]]]:
    from mlx.utils import tree_flatten

    return [(k, tuple(v.shape)) for k, v in tree_flatten(model.parameters())]


def weight_bytes(model, plane: str, dtype: str) -> int:
    """The plane's bytes for the model's parameters (int8g64: 1 byte a code and a bf16 scale and bias per
    64 for each matrix mlx-lm quantizes; the rest in the compute dtype)."""
    other = 4 if dtype == "float32" else 2
    total = 0
    for name, shape in _params(model):
        n = 1
        for d in shape:
            n *= d
        quantized = plane == "int8g64" and name.endswith("weight") and len(shape) >= 2 and shape[-1] % 64 == 0 \
            and "conv.conv" not in name
        total += n + n // 64 * 4 if quantized else n * other
    return total


def kv_bytes(config: dict, rows: int, tokens: int, dtype: str) -> int:
    """KV cache of `rows` contexts of `tokens` each: attention layers x 2 x kv heads x head dim."""
    layers = config.get("layer_types")
    attn = sum(t == "full_attention" for t in layers) if layers else int(config["num_hidden_layers"])
    heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))
    return attn * 2 * heads * head_dim * rows * tokens * (4 if dtype == "float32" else 2)


def worker_memory(model, config: dict, *, plane: str, dtype: str, n_samples: int, max_new_tokens: int,
                  groups: int = 1) -> dict[str, int]:
    """Bytes the MLX worker needs: weights, the reconstructor's plane, a patch's new tensors, KV, overhead."""
    w = weight_bytes(model, plane, "bfloat16")  # the published plane: bf16 outside the quantized matrices
    held = weight_bytes(model, plane, dtype)
    kv = kv_bytes(config, n_samples * groups, max_new_tokens + PROMPT_TOKENS, dtype)
    parts = {"weights": held, "plane_copy": w, "patch_result": w, "kv_cache": kv, "overhead": OVERHEAD_BYTES}
    return {**parts, "total": sum(parts.values())}


def total_bytes(env=None) -> int | None:
    """The memory the worker may use: DRL_WORKER_MEMORY_GB where set (a share of a machine others use too),
    else this machine's physical memory (None where the OS does not say)."""
    raw = (env or {}).get("DRL_WORKER_MEMORY_GB", "").strip()
    if raw:
        try:
            gb = float(raw)
        except ValueError:
            gb = -1.0
        if not gb > 0:
            raise ValueError(f"DRL_WORKER_MEMORY_GB={raw!r} is not a positive number of GB: set it to the memory "
                             "this worker may use, e.g. 12, or unset it to use the machine's")
        return int(gb * 1e9)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(need: dict[str, int], total: int | None, what: str) -> None:
    """ValueError in one sentence where `need` does not fit in `total` bytes."""
    if total is None or need["total"] <= total:
        return
    gb = lambda b: f"{b / 1e9:.1f} GB"  # noqa: E731
    raise ValueError(f"this machine has {gb(total)} of memory and the MLX worker needs about {gb(need['total'])} "
                     f"for {what} (weights {gb(need['weights'])}, the published plane and a patch's result "
                     f"{gb(need['plane_copy'] + need['patch_result'])}, KV cache {gb(need['kv_cache'])}): run it on "
                     "a machine of the tier docs/mac-worker.md names for this model")
