"""Creating a run: run.json from the recipe and the HF model's identity, the run's signing key, and the HF
weights as the v1 anchor. The one way every engine starts (or identically resumes) a run.

    start = create_run(cfg, store, model_dir, key_file, publish_base=...)

Idempotent: the key is created on first use (0600) and reused (never made again for a run that exists: KeyLost); run.json is created once and resumed only
with an identical contract (same trainer key, model identity and recipe values); the base anchor is
published only while the run has no pointer. `publish_base` says who writes v1: the slime engine asks for
it here (slime's learner publishes nothing before its first step), the native learner publishes its own
anchor when its session starts (pointer + 1, or 1 for a new run; trainer/native/learner.py), so it passes False.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker_contract.manifest import RunManifest

from .config import RecipeConfig


@dataclass(frozen=True)
class RunStart:
    """What creating (or resuming) a run leaves to its caller."""

    manifest: RunManifest
    key: Any  # the run's Ed25519PrivateKey (signs what the publisher writes)
    fingerprint: str  # of the trainer's public key: the workers' join card value
    base_version: int | None  # the v1 anchor this call published; None when it published none
    pointer: int | None  # with publish_base: the pointer the run already had (None: it had none)
    anchor_bytes: int = 0
    reclaimed: str | None = None  # a forged pointer found on start and reclaimed: the sentence saying so


def run_manifest(cfg: RecipeConfig, identity: Any, public_key: str) -> RunManifest:
    """run.json from the recipe and the HF model's identity (trainer.models.ModelIdentity)."""
    a = cfg.algo
    return RunManifest(
        run=cfg.run, n_samples=cfg.contract.n_samples, plane=cfg.contract.plane, kv_mode=cfg.contract.kv_mode,
        task=cfg.task, model_id=str(cfg.model.path) if cfg.model.path else cfg.model.hf_id, **identity.manifest_values(),
        temperature=a.temperature, top_p=a.top_p, max_new_tokens=a.max_new_tokens, staleness=a.staleness,
        anchor_interval=cfg.train.anchor_interval, trainer_public_key=public_key,
    )


class KeyLost(ValueError):
    """The run exists in the store, but the signing key it was created with is not where the run keeps it."""


def _refuse_a_lost_key(store: Any, run: str, key_file: Path) -> None:
    """A new key for an existing run could never resume it (run.json names the old one) and would stand in
    the old one's place: refuse before any key is made, so a restored backup is still all it takes."""
    if key_file.exists():
        return
    from worker_contract.manifest import load_manifest
    from worker_contract.signing import fingerprint
    from worker_contract.store import NotFound

    try:
        published = load_manifest(store, run)
    except NotFound:
        return  # a new run: its key is made now
    raise KeyLost(f"run {run!r} exists in {store.url} (trainer key {fingerprint(published.trainer_public_key)}), "
                  f"but its signing key {key_file} is gone: restore that file from a backup to resume the run, or "
                  "start a fresh run under another run id")


def create_run(cfg: RecipeConfig, store: Any, model_dir: str | Path, key_file: str | Path, *, publish_base: bool,
               progress: bool = True) -> RunStart:
    """Create (or identically resume) the run in `store` for the HF model in `model_dir`.

    The model's identity is checked against the recipe's rotary base before anything is written and
    against an existing run.json after; ContractMismatch / IdentityMismatch refuse a different run."""
    from worker_contract.manifest import create_or_resume
    from worker_contract.signing import fingerprint, load_or_create_private_key, public_key_b64

    from .models import check_model_identity, identity_from_hf

    identity = identity_from_hf(model_dir)
    check_model_identity(identity, rotary_base=cfg.model.rotary_base, rotary_base_source="recipe model.rotary_base")
    _refuse_a_lost_key(store, cfg.run, Path(key_file))
    Path(key_file).parent.mkdir(parents=True, exist_ok=True)
    key = load_or_create_private_key(key_file)
    pub_b64 = public_key_b64(key)
    manifest = create_or_resume(store, run_manifest(cfg, identity, pub_b64), resume=True)
    check_model_identity(identity, manifest=manifest)
    from .publish.publisher import Publisher

    pub = Publisher(store, manifest, key, anchor_interval=cfg.train.anchor_interval, progress=progress)
    reclaimed = pub.reclaim_pointer()  # a forged pointer would keep every worker from joining until a step
    if not publish_base:
        return RunStart(manifest, key, fingerprint(pub_b64), base_version=None, pointer=None, reclaimed=reclaimed)
    from .models.hf_io import iter_tensors, safetensors_files

    current = pub.current_version()
    if current is not None:
        return RunStart(manifest, key, fingerprint(pub_b64), base_version=None, pointer=current, reclaimed=reclaimed)
    version = pub.publish_anchor(dict(iter_tensors(safetensors_files(model_dir))))
    return RunStart(manifest, key, fingerprint(pub_b64), base_version=version, pointer=None,
                    anchor_bytes=int((pub.last_stats or {}).get("anchor_bytes", 0)), reclaimed=reclaimed)
