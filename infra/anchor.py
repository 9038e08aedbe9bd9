"""The launch step `publish_anchor` (infra/launch_gpu.py): the box's store and paths handed to
trainer.run_init.create_run, which writes run.json and the HF model as the v1 anchor (idempotent).

The trainer's signing key lives beside the run's state on the box (`<state>/trainer.key`, 0600) and is
created on first use.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from trainer.config import RecipeConfig

from .slime_launch import BoxPaths


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
    """Create (or identically resume) run.json and publish the HF base as the first anchor
    (trainer.run_init.create_run, the one way every engine creates a run)."""
    from trainer.run_init import create_run

    store = open_run_store(cfg, paths, env)
    start = create_run(cfg, store, paths.hf_dir(cfg.model.hf_id), paths.key_file, publish_base=True,
                       progress=progress)
    if start.base_version is None:
        return (f"run.json exists, pointer at v{start.pointer}: base already published "
                f"(trainer key {start.fingerprint})" + (f"; {start.reclaimed}" if start.reclaimed else ""))
    return (f"v{start.base_version} anchor ({start.anchor_bytes / 1e6:.0f} MB, {cfg.contract.plane}) in {cfg.store}; "
            f"trainer key {start.fingerprint}")
