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


def local_identity(model_dir: str | Path) -> dict[str, Any]:
    """The identity fields of run.json, read from a local HF directory (config.json + tokenizer files)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ContractMismatch(f"{path} is missing: --model must be an HF model directory (config.json, "
                               "tokenizer.json)")
    cfg = json.loads(path.read_text())
    heads = int(cfg["num_attention_heads"])
    archs = cfg.get("architectures") or [f"{cfg.get('model_type', '?')}ForCausalLM"]
    return {
        "architecture": archs[0],
        "rope_theta": rope_theta(cfg),
        "vocab_size": int(cfg["vocab_size"]),
        "hidden_size": int(cfg["hidden_size"]),
        "num_layers": int(cfg["num_hidden_layers"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(cfg.get("num_key_value_heads") or heads),
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
