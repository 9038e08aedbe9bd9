"""The run the plugin serves, built once per process from what the launch left on the box.

slime loads our functions by dotted path inside its Ray actors and passes them only its own argparse
namespace, so the run comes from the job's runtime env (infra/slime_launch.runtime_env):

    DRL_RECIPE_FILE   the resolved RecipeConfig (JSON) the launch wrote
    DRL_ENV_FILE      the box's credentials file (.r2env, mode 0600)
    DRL_STATE_DIR     the run's state dir: trainer.key and the hand-off between slime's processes
More in docs/slime.md (module notes).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.config import RecipeConfig
from worker_contract.manifest import RunManifest, load_manifest
from worker_contract.store import NotFound, Store

from . import handoff


def _need(var: str) -> str:
    value = os.environ.get(var, "").strip()
    if not value:
        raise ValueError(f"{var} is not set: the slime plugin runs inside the job `make gsm8k` launches "
                         "(infra/slime_launch.runtime_env sets it); set it to run the plugin by hand")
    return value


@dataclass
class PluginContext:
    """The parts of trainer/session.py this process drives: the rollout side in slime's rollout process,
    the learner session in its train process."""

    cfg: RecipeConfig
    store: Store
    manifest: RunManifest
    state_dir: Path
    _rollouts: Any = None
    _handoff: Any = None
    _session: Any = None
    _lock: threading.RLock = field(default_factory=threading.RLock)

    @property
    def run(self) -> str:
        return self.manifest.run

    def current_version(self) -> int:
        """The newest published version (the signed pointer); the learner trains from it."""
        from worker_contract.pointer import PointerError, read_pointer

        try:
            pointer, _ = read_pointer(self.store, self.run, self.manifest.trainer_public_key)
        except PointerError:  # a forged pointer: the publisher knows the newest version the run key signed
            version = self.session().publisher.current_version()
            if version:
                return version
            raise
        if pointer is None:
            raise ValueError(f"run {self.run!r} has no pointer yet: publish the base anchor first "
                             "(the launch's publish_anchor step)")
        return pointer.version

    def rollouts(self, model_dir: str | None = None):
        """The rollout side (trainer/session.RolloutSide), its reuse ledger restored from the hand-off;
        `model_dir` (slime's --hf-checkpoint) names the model whose MoE routes records carry."""
        with self._lock:
            if self._rollouts is None:
                from trainer.session import RolloutSide

                self._handoff = handoff.read(self.state_dir)
                self._rollouts = RolloutSide(self.store, self.manifest, self.cfg.algo,
                                             self.cfg.train.poll_interval_s, ledger=self._handoff.ledger,
                                             model_dir=model_dir or self.cfg.model.path)
            return self._rollouts

    def hand_over(self, rollout_id: int, note) -> None:
        """The rollout side's part: the batch's note and the ledger after it, for the train processes."""
        with self._lock:
            self._handoff.record(rollout_id, note, self.rollouts().ledger_state())
            handoff.write(self.state_dir, self._handoff)

    def note_for(self, rollout_id: int):
        """The train side's part: the note the rollout side wrote for `rollout_id` (None: there is none)."""
        return handoff.read(self.state_dir).note_for(rollout_id)

    def session(self):
        """The learner session (trainer/session.LearnerSession) with the run's key (created by the launch,
        0600 in the state dir): the worker audit, the publisher, its queue and the versions' stats."""
        with self._lock:
            if self._session is None:
                from trainer.session import LearnerSession
                from worker_contract.signing import load_private_key

                key = load_private_key(self.state_dir / "trainer.key")
                self._session = LearnerSession(self.cfg, self.store, self.manifest, key, progress=False)
            return self._session

    def started_session(self):
        """The learner session if this process has one (rank 0 after its first publish), else None."""
        with self._lock:
            return self._session


_context: PluginContext | None = None
_context_lock = threading.Lock()


def context() -> PluginContext:
    """The process's PluginContext, built on first use from DRL_RECIPE_FILE / DRL_ENV_FILE / DRL_STATE_DIR."""
    global _context
    with _context_lock:
        if _context is None:
            from worker_contract.env import load_env
            from worker_contract.store import open_store

            cfg = RecipeConfig.model_validate_json(Path(_need("DRL_RECIPE_FILE")).read_text())
            env_file = os.environ.get("DRL_ENV_FILE", "").strip() or None
            env = load_env(env_file=env_file if env_file and Path(env_file).exists() else None,
                           repo_root=Path(_need("DRL_STATE_DIR")))
            if not cfg.store or not cfg.run:
                raise ValueError(f"{os.environ['DRL_RECIPE_FILE']}: the recipe has no store or run; it must be "
                                 "the resolved recipe the launch writes")
            store = open_store(cfg.store, env)
            try:
                manifest = load_manifest(store, cfg.run)
            except NotFound:
                raise ValueError(f"run {cfg.run!r} has no run.json in {cfg.store}: the launch's publish_anchor "
                                 "step creates it") from None
            _context = PluginContext(cfg=cfg, store=store, manifest=manifest,
                                     state_dir=Path(_need("DRL_STATE_DIR")))
        return _context


def reset_context() -> None:
    """Forget the cached context (a new run in the same process, or tests)."""
    global _context
    with _context_lock:
        if _context is not None and _context._session is not None:
            _context._session.close()  # what was handed over is published first
        _context = None


def check_args(args: Any, manifest: RunManifest, cfg: RecipeConfig) -> None:
    """slime's flags must match the run's contract; `args` None (slime's contract test) skips this."""
    if args is None:
        return
    pairs = [
        ("--n-samples-per-prompt", "n_samples_per_prompt", manifest.n_samples, "run.json n_samples (DRL_N_SAMPLES)"),
        ("--rollout-batch-size", "rollout_batch_size", cfg.algo.groups_per_step, "recipe algo.groups_per_step"),
        ("--rollout-temperature", "rollout_temperature", manifest.temperature, "run.json temperature"),
    ]
    for flag, attr, want, what in pairs:
        have = getattr(args, attr, None)
        if have is not None and float(have) != float(want):
            raise ValueError(f"slime {flag} {have} differs from {what} = {want}: relaunch with the generated "
                             "command (infra/slime_launch.py), which sets it from the recipe")
