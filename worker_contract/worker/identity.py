"""The worker's side of "model identity is checked, not assumed": its local config and tokenizer
against `run.json`, field by field, before it samples anything.

The digests are computed exactly as the trainer computes them when it writes run.json (sha256 of
tokenizer.json re-serialised canonically; sha256 of the chat template text, '' when there is none);
tests/test_worker.py checks that both sides agree on the same directory. They live here, not in the
trainer's code, because the contract package never imports the trainer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import model_digests
from ..manifest import ContractMismatch, RunManifest


def tokenizer_digest(model_dir: str | Path) -> str:
    try:
        return model_digests.tokenizer_digest(model_dir)
    except ValueError as e:
        raise ContractMismatch(f"{e}: the worker needs the model's tokenizer.json to check it against run.json") from None


chat_template_text = model_digests.chat_template_text


def rope_theta(cfg: Mapping[str, Any]) -> float | None:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta")) if isinstance(params, Mapping) else None
    return None if theta is None else float(theta)


def rope_scaling(cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    """The rope scaling as run.json records it (the trainer's reading): None for plain RoPE; llama3's
    rope_type and four numbers; any other type as its fields, which then match no run.json."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default")) if isinstance(params, Mapping) else None
    if rope_type in (None, "default"):
        return None
    if rope_type != "llama3":
        return {k: v for k, v in params.items() if k != "rope_theta"}
    out: dict[str, Any] = {"rope_type": "llama3"}
    for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        v = params.get(k)
        ok = isinstance(v, int | float) and not isinstance(v, bool)
        out[k] = (int(v) if k == "original_max_position_embeddings" else float(v)) if ok else v
    return out


def local_identity(model_dir: str | Path) -> dict[str, Any]:
    """The identity fields of run.json, read from a local HF directory (config.json + tokenizer files)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ContractMismatch(f"{path} is missing: --model must be an HF model directory (config.json, "
                               "tokenizer.json)")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ContractMismatch(f"{path} is not valid JSON ({e}): --model must be an HF model directory") from None
    if not isinstance(cfg, dict):
        raise ContractMismatch(f"{path} must hold a JSON object, got {type(cfg).__name__}: --model must be an HF "
                               "model directory")
    sizes = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in sizes if not isinstance(cfg.get(k), int) or isinstance(cfg.get(k), bool)]
    if missing:
        raise ContractMismatch(f"{path} lacks integer field(s) {', '.join(missing)}: --model must be the HF "
                               "directory of a decoder LM (config.json, tokenizer.json)")
    heads = cfg["num_attention_heads"]
    archs = cfg.get("architectures") or [f"{cfg.get('model_type', '?')}ForCausalLM"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    return {
        "architecture": str(archs[0]) if isinstance(archs, list) else str(archs),
        "rope_theta": rope_theta(cfg),
        "rope_scaling": rope_scaling(cfg),
        "vocab_size": cfg["vocab_size"],
        "hidden_size": cfg["hidden_size"],
        "num_layers": cfg["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads if isinstance(kv_heads, int) else heads,
        "tokenizer_digest": tokenizer_digest(model_dir),
        "chat_template_digest": model_digests.chat_template_digest(model_dir),
    }


def check_identity(model_dir: str | Path, manifest: RunManifest) -> None:
    """Raise ContractMismatch naming every identity field where the local model differs from run.json."""
    mine = local_identity(model_dir)
    diffs = [(k, v, getattr(manifest, k)) for k, v in mine.items() if v != getattr(manifest, k)]
    if diffs:
        rows = "\n".join(f"  {k}: local model has {a!r}, run.json has {b!r}" for k, a, b in diffs)
        raise ContractMismatch(
            f"the model at {model_dir} is not the model of run {manifest.run!r}; refusing to sample:\n{rows}\n"
            f"(point --model at the run's model, {manifest.model_id!r})"
        )
