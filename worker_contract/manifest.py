"""`run.json`: the run manifest, published once (create-only) by the trainer before anything else.

It fixes the contract of the run: a worker compares its own values with these and fails closed on any
difference. Creating a run that exists is refused; resuming one is allowed only with an identical contract,
and a difference is reported field by field.
"""

from __future__ import annotations

import json
import time
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import layout
from .planes import PlaneName
from .store import PreconditionFailed, Store


class RunManifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    contract_version: Literal[1] = layout.CONTRACT_VERSION
    """Version of the bucket layout and wire formats."""
    run: str
    """DRL_RUN: the run id and bucket prefix."""
    n_samples: int = Field(ge=1)
    """DRL_N_SAMPLES: the group size every record must have."""
    plane: PlaneName
    """DRL_PULSE_PLANE: the weight plane of anchors and patches."""
    kv_mode: str | None = None
    """DRL_KV_MODE: the workers' KV-cache mode (fleet: paged_prefix)."""
    task: str
    """Task name; worker and trainer score with the same code."""
    model_id: str
    """HF repo id or a description of the locally built base."""
    architecture: str
    """HF architecture class, e.g. Qwen2ForCausalLM."""
    rope_theta: float
    """Rotary base; must equal the HF config's and the Megatron checkpoint's."""
    rope_scaling: dict[str, str | int | float] | None = None
    """Rope scaling (llama3: rope_type, factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings); None for plain RoPE. Must equal the HF config's."""
    vocab_size: int = Field(ge=1)
    """Embedding rows; token ids at or above it are refused."""
    hidden_size: int = Field(ge=1)
    """Model width (identity check)."""
    num_layers: int = Field(ge=1)
    """Decoder layers (identity check)."""
    num_attention_heads: int = Field(ge=1)
    """Query heads (identity check)."""
    num_key_value_heads: int = Field(ge=1)
    """KV heads (identity check)."""
    tokenizer_digest: str
    """sha256 of the tokenizer's canonical JSON."""
    chat_template_digest: str
    """sha256 of the chat template text ('' hashed when there is none)."""
    temperature: float = Field(gt=0)
    """Sampling temperature workers must use (the learner divides logits by it)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus cutoff workers must use."""
    max_new_tokens: int = Field(ge=1)
    """Response budget per sample."""
    staleness: int = Field(ge=0)
    """Rollouts older than this many versions are dropped by the learner."""
    anchor_interval: int = Field(ge=1)
    """A full anchor every this many versions."""
    trainer_public_key: str
    """Base64 raw Ed25519 public key that signs the pointer, anchor manifests and patches."""
    created_at: float = Field(default_factory=time.time)
    """Unix time of creation (not part of the contract comparison)."""

    #: fields that may differ between a run's creation and a resume
    NON_CONTRACT: ClassVar[frozenset[str]] = frozenset({"created_at"})

    def to_bytes(self) -> bytes:
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> RunManifest:
        return cls.model_validate_json(data)

    def contract_diff(self, other: RunManifest) -> list[tuple[str, object, object]]:
        """(field, this value, other value) for every contract field that differs."""
        out = []
        for name in type(self).model_fields:
            if name in self.NON_CONTRACT:
                continue
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                out.append((name, a, b))
        return out


class RunExists(ValueError):
    """A run with this id already exists and may not be created again."""


class ContractMismatch(ValueError):
    """A resume (or a worker) disagrees with the run's published contract."""


def load_manifest(store: Store, run: str) -> RunManifest:
    """The published manifest; `NotFound` if the run has none, a one-line ValueError naming the object if it
    is not a run manifest (anyone with the bucket's credentials can overwrite it)."""
    key = layout.manifest_key(run)
    data = store.get(key)
    try:
        return RunManifest.from_bytes(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        raise ValueError(f"{key} in {store.url} is not a valid run manifest ({where + ': ' if where else ''}"
                         f"{err['msg']}); the trainer writes it once: check the store and the run id") from None


def format_diff(diff: list[tuple[str, object, object]], left: str, right: str) -> str:
    rows = [f"  {name}: {left}={a!r} {right}={b!r}" for name, a, b in diff]
    return "\n".join(rows)


def model_id_is_a_path(model_id: str) -> bool:
    """Whether run.json's model_id is a directory on the trainer's machine (an embedded run's own base: no hub
    holds it, so a worker elsewhere needs its config and tokenizer copied), not a hub id `org/name`."""
    return model_id.startswith(("/", "~", "./", "../")) or model_id.count("/") > 1


def create_or_resume(store: Store, manifest: RunManifest, *, resume: bool) -> RunManifest:
    """Publish `manifest` create-only; on an existing run, resume only if asked and the contract is identical."""
    key = layout.manifest_key(manifest.run)
    try:
        store.put_if_absent(key, manifest.to_bytes())
        return manifest
    except PreconditionFailed:
        existing = load_manifest(store, manifest.run)
    if not resume:
        raise RunExists(
            f"run {manifest.run!r} already exists in {store.url}; choose a fresh DRL_RUN, or resume it "
            "with an identical contract"
        )
    diff = existing.contract_diff(manifest)
    if diff:
        raise ContractMismatch(
            f"run {manifest.run!r} exists with a different contract; refusing to resume:\n"
            + format_diff(diff, "published", "requested")
        )
    return existing
