"""Publish the run's contract and its base weights: run.json, then the HF model as the v1 anchor.

The launch step `publish_anchor` (infra/launch_gpu.py). Idempotent: run.json is created once and resumed
only with an identical contract (same trainer key, model identity and recipe values), and the anchor is
published only while the pointer does not exist yet. The trainer's signing key lives beside the run's
state on the box (`<state>/trainer.key`, 0600) and is created on first use.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer.config import RecipeConfig
from worker_contract.manifest import RunManifest

from .slime_launch import BoxPaths


def run_manifest(cfg: RecipeConfig, identity: Any, public_key: str) -> RunManifest:
    """run.json from the recipe and the HF model's identity (trainer.models.ModelIdentity)."""
    a = cfg.algo
    return RunManifest(
        run=cfg.run, n_samples=cfg.contract.n_samples, plane=cfg.contract.plane, kv_mode=cfg.contract.kv_mode,
        task=cfg.task, model_id=str(cfg.model.path) if cfg.model.path else cfg.model.hf_id, **identity.manifest_values(),
        temperature=a.temperature, top_p=a.top_p, max_new_tokens=a.max_new_tokens, staleness=a.staleness,
        anchor_interval=cfg.train.anchor_interval, trainer_public_key=public_key,
    )


def open_run_store(cfg: RecipeConfig, paths: BoxPaths, env: Mapping[str, str] | None = None):
    """The run's store, with credentials from the box's .r2env (0600) and the environment."""
    from worker_contract.env import load_env
    from worker_contract.store import open_store

    if env is None:
        env_file = Path(paths.env_file)
        env = load_env(env_file=env_file if env_file.exists() else None, repo_root=paths.remote_dir)
    if not cfg.store:
        raise ValueError("store is not resolved: set DRL_STORE or the four R2 values (docs/r2-setup.md)")
    return open_store(cfg.store, env)


def publish_base_anchor(cfg: RecipeConfig, paths: BoxPaths, env: Mapping[str, str] | None = None,
                        progress: bool = True) -> str:
    """Create (or identically resume) run.json and publish the HF base as the first anchor."""
    from trainer.models import check_model_identity, identity_from_hf
    from trainer.models.hf_io import iter_tensors, safetensors_files
    from trainer.publisher import Publisher
    from worker_contract.manifest import create_or_resume
    from worker_contract.signing import fingerprint, load_or_create_private_key, public_key_b64

    hf_dir = paths.hf_dir(cfg.model.hf_id)
    identity = identity_from_hf(hf_dir)
    check_model_identity(identity, rotary_base=cfg.model.rotary_base, rotary_base_source="recipe model.rotary_base")
    store = open_run_store(cfg, paths, env)
    Path(paths.state_dir).mkdir(parents=True, exist_ok=True)
    key = load_or_create_private_key(paths.key_file)
    manifest = create_or_resume(store, run_manifest(cfg, identity, public_key_b64(key)), resume=True)
    check_model_identity(identity, manifest=manifest)
    pub = Publisher(store, manifest, key, anchor_interval=cfg.train.anchor_interval, progress=progress)
    current = pub.current_version()
    fp = fingerprint(manifest.trainer_public_key)
    if current is not None:
        return f"run.json exists, pointer at v{current}: base already published (trainer key {fp})"
    state = dict(iter_tensors(safetensors_files(hf_dir)))
    version = pub.publish_anchor(state)
    mb = pub.last_stats.get("anchor_bytes", 0) / 1e6
    return f"v{version} anchor ({mb:.0f} MB, {cfg.contract.plane}) in {cfg.store}; trainer key {fp}"
