"""Model identity: the values that make the trainer the same model as the workers, checked, not assumed.

The rotary base, vocabulary, shapes and tokenizer digests are read from the HF checkpoint, recorded beside
the Megatron checkpoint (`model_identity.json`) and in `run.json`, and compared field by field before
conversion and again at launch. A rotary base given on the command line or in the recipe
(`model.rotary_base`) that differs from the HF config's `rope_theta` is refused: slime's stock
Qwen2.5-1.5B arguments carry 10000 while the HF model uses 1000000, and the wrong one makes the trainer a
different model from the workers (the importance ratios become meaningless).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from worker_contract import model_digests

from .hf_io import ConvertError, load_hf_config, rope_scaling_of, rope_theta_of

IDENTITY_FILE = "model_identity.json"
IDENTITY_VERSION = 1

#: identity field -> RunManifest field holding the same value (worker_contract/manifest.py)
MANIFEST_FIELDS: dict[str, str] = {
    "architecture": "architecture",
    "rope_theta": "rope_theta",
    "rope_scaling": "rope_scaling",
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_layers": "num_layers",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_key_value_heads",
    "tokenizer_digest": "tokenizer_digest",
    "chat_template_digest": "chat_template_digest",
}


class IdentityMismatch(ValueError):
    """Two sources disagree on a model-identity field; the message names every field and both values."""


class ModelIdentity(BaseModel):
    """Everything that must agree between the HF model, the Megatron checkpoint and `run.json`."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    identity_version: int = IDENTITY_VERSION
    """Version of this record's format."""
    architecture: str
    """HF architecture class, e.g. Qwen2ForCausalLM."""
    model_type: str
    """HF model_type, the key of the conversion registry (e.g. qwen2)."""
    rope_theta: float
    """Rotary base from the HF config; the only accepted value for --rotary-base / model.rotary_base."""
    rope_scaling: dict[str, str | int | float] | None = None
    """Rope scaling from the HF config (hf_io.rope_scaling_of: llama3's four parameters), None for plain RoPE."""
    vocab_size: int
    """Embedding rows of the HF model (token ids at or above are invalid)."""
    padded_vocab_size: int
    """Embedding rows in the Megatron checkpoint (>= vocab_size; extra rows are zero and masked)."""
    hidden_size: int
    """Model width."""
    intermediate_size: int
    """SwiGLU width."""
    num_layers: int
    """Decoder layers."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads (query groups)."""
    head_dim: int
    """Channels per head."""
    rms_norm_eps: float
    """RMSNorm epsilon."""
    tie_word_embeddings: bool
    """Whether the output layer shares the embedding matrix."""
    tokenizer_digest: str
    """sha256 of tokenizer.json in canonical JSON form (sorted keys, compact)."""
    chat_template_digest: str
    """sha256 of the chat template text ('' hashed when there is none)."""

    def manifest_values(self) -> dict[str, Any]:
        """The values that go into `run.json` (RunManifest field -> value)."""
        return {m: getattr(self, f) for f, m in MANIFEST_FIELDS.items()}

    def write(self, directory: str | Path) -> Path:
        path = Path(directory) / IDENTITY_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True) + "\n")
        tmp.replace(path)
        return path


def tokenizer_digest(hf_dir: str | Path) -> str:
    """sha256 over tokenizer.json re-serialised canonically (worker_contract.model_digests, as workers do)."""
    try:
        return model_digests.tokenizer_digest(hf_dir)
    except ValueError as e:
        raise ConvertError(f"{e}; copy the model's tokenizer.json into the checkpoint directory") from None


def chat_template_text(hf_dir: str | Path) -> str:
    try:
        return model_digests.chat_template_text(hf_dir)
    except ValueError as e:
        raise ConvertError(str(e)) from None


def chat_template_digest(hf_dir: str | Path) -> str:
    return model_digests.sha256_tagged(chat_template_text(hf_dir).encode("utf-8"))


def identity_from_hf(hf_dir: str | Path, *, padded_vocab_size: int | None = None) -> ModelIdentity:
    """Read the identity of an HF checkpoint directory (config.json + tokenizer files)."""
    cfg = load_hf_config(hf_dir)
    return identity_from_config(
        cfg,
        tokenizer_digest=tokenizer_digest(hf_dir),
        chat_template_digest=chat_template_digest(hf_dir),
        padded_vocab_size=padded_vocab_size,
    )


def identity_from_config(
    cfg: Mapping[str, Any], *, tokenizer_digest: str, chat_template_digest: str, padded_vocab_size: int | None = None
) -> ModelIdentity:
    heads = int(cfg["num_attention_heads"])
    vocab = int(cfg["vocab_size"])
    padded = vocab if padded_vocab_size is None else int(padded_vocab_size)
    if padded < vocab:
        raise ValueError(f"padded_vocab_size={padded} is below the model's vocab_size={vocab}; use >= {vocab}")
    archs = cfg.get("architectures") or []
    return ModelIdentity(
        architecture=str(archs[0]) if archs else f"{cfg['model_type']}ForCausalLM",
        model_type=str(cfg["model_type"]),
        rope_theta=rope_theta_of(cfg),
        rope_scaling=rope_scaling_of(cfg),
        vocab_size=vocab,
        padded_vocab_size=padded,
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        tokenizer_digest=tokenizer_digest,
        chat_template_digest=chat_template_digest,
    )


def read_identity(ckpt_root: str | Path) -> ModelIdentity:
    """The identity recorded beside a converted checkpoint."""
    path = Path(ckpt_root) / IDENTITY_FILE
    if not path.is_file():
        raise ConvertError(
            f"{path} is missing: {ckpt_root} was not written by `invoke convert` (or the conversion did not "
            "finish); convert the HF checkpoint again"
        )
    try:
        return ModelIdentity.model_validate_json(path.read_text())
    except ValueError as e:
        raise ConvertError(f"{path} is malformed: {e}") from None


#: properties of a converted checkpoint rather than of the model itself
_CHECKPOINT_ONLY = frozenset({"identity_version", "padded_vocab_size"})


def _diff(left: Mapping[str, Any], right: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    return [(k, left[k], right[k]) for k in left if k in right and left[k] != right[k]]


def _rotary_problem(theta: float, rotary_base: float | None, source: str) -> str | None:
    if rotary_base is None or float(rotary_base) == theta:
        return None
    return (f"rotary base {_num(rotary_base)} ({source}) differs from the HF config's rope_theta {_num(theta)}: the "
            f"trainer would be a different model from the workers. Remove the override or set it to {_num(theta)}")


def checked_rotary_base(hf_config: Mapping[str, Any], rotary_base: float | None,
                        source: str = "recipe model.rotary_base") -> float:
    """The rotary base to build or launch with, read once for every caller: the HF config's (hf_io.rope_theta_of);
    a `rotary_base` override that differs is refused (IdentityMismatch naming both values and the fix)."""
    theta = rope_theta_of(hf_config)
    if problem := _rotary_problem(theta, rotary_base, source):
        raise IdentityMismatch(problem)
    return theta


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def check_model_identity(
    hf: ModelIdentity,
    *,
    rotary_base: float | None = None,
    rotary_base_source: str = "--rotary-base / model.rotary_base",
    checkpoint: ModelIdentity | None = None,
    manifest: Any | None = None,
) -> ModelIdentity:
    """Refuse any disagreement between the HF model and a requested rotary base, a converted checkpoint's
    recorded identity, or a run manifest (an object or mapping with RunManifest's field names).

    Returns `hf` when everything agrees; raises IdentityMismatch naming every differing field, both
    values, and the fix.
    """
    problems: list[str] = [p for p in [_rotary_problem(hf.rope_theta, rotary_base, rotary_base_source)] if p]
    mine = hf.model_dump()
    if checkpoint is not None:
        theirs = {k: v for k, v in checkpoint.model_dump().items() if k not in _CHECKPOINT_ONLY}
        for field, a, b in _diff(mine, theirs):
            problems.append(f"{field}: HF model has {a!r}, the Megatron checkpoint records {b!r}")
    if manifest is not None:
        values = manifest if isinstance(manifest, Mapping) else {m: getattr(manifest, m) for m in MANIFEST_FIELDS.values()}
        ours = hf.manifest_values()
        for field, a, b in _diff(ours, values):
            problems.append(f"{field}: HF model has {a!r}, run.json has {b!r}")
    if problems:
        raise IdentityMismatch(
            "model identity check failed:\n  - " + "\n  - ".join(problems)
            + "\n(the HF checkpoint is the source of truth; re-convert it or fix the recipe/run)"
        )
    return hf
