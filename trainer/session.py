"""One learner session: the learner's parts wired once, driven by both engines.

`RolloutSide` is the rollout source with its pool and ledger, handing out each batch with its note;
`LearnerSession` is the train side: the worker audit, the publisher and its queue writing each version's
stats, the step count and current version, checkpoints. The native learner (trainer/native/learner.py) runs the
two in two Ray actors; slime runs them in its rollout and train processes (trainer/slime_plugin/), which
hand notes across through one file (trainer/slime_plugin/handoff.py). The step functions are trainer/step.py.
More in docs/architecture.md (module notes).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker_contract.manifest import RunManifest
from worker_contract.store import Store

from .config import AlgoConfig, RecipeConfig
from .rollouts.audit import WorkerAudit
from .step import BatchNote, SourceCounts, StepReport, note_batch, source_counts, step_report

if TYPE_CHECKING:
    from .backends.base import Backend
    from .checkpoint import TrainerState
    from .rollouts.pool import Batch


class RolloutSide:
    """The bucket rollout source (trainer/rollouts/source.py: listing, judging, the pool and its reuse ledger)."""

    def __init__(self, store: Store, manifest: RunManifest, algo: AlgoConfig, poll_interval_s: float,
                 ledger: dict | None = None, model_dir: str | Path | None = None):
        """`model_dir`: the HF directory of the run's model, whose config says whether records carry MoE
        routes (worker_contract/routes.py); None: a dense model's run."""
        from .rollouts.source import RolloutSource

        self.source = RolloutSource.from_manifest(store, manifest, algo, routes=model_route_shape(model_dir))
        if ledger:
            self.source.load_ledger_state(ledger)
        self.poll_interval_s = poll_interval_s

    def next_batch(self, current: int, timeout_s: float, stop_event: threading.Event | None = None
                   ) -> tuple[Batch, BatchNote] | None:
        """A batch for version `current` and its note, or None after `timeout_s` (or on `stop_event`)."""
        batch = self.source.next_batch(current, timeout_s=timeout_s, poll_interval_s=self.poll_interval_s,
                                       stop_event=stop_event)
        return None if batch is None else (batch, note_batch(batch, self.source))

    def counts(self) -> SourceCounts:
        return source_counts(self.source)

    def ledger_state(self) -> dict:
        return self.source.ledger_state()

    def load_ledger_state(self, state: dict) -> None:
        self.source.load_ledger_state(state)


def model_route_shape(model_dir: str | Path | None):
    """The MoE route shape of the HF model in `model_dir` (None: no directory, or a dense model)."""
    if model_dir is None:
        return None
    from worker_contract.routes import route_shape

    from .models.hf_io import load_hf_config

    return route_shape(load_hf_config(model_dir))


@dataclass
class Resumed:
    """What a session's start found under its checkpoints."""

    path: Path | None
    state: TrainerState | None
    skipped: list[str] = field(default_factory=list)
    """Damaged newer checkpoints passed over, one sentence each (the driver says them)."""


class LearnerSession:
    """The train side: audit, publisher, publish queue and version stats, step and version, checkpoints."""

    def __init__(self, cfg: RecipeConfig, store: Store, manifest: RunManifest, key, *,
                 run_dir: str | Path | None = None, progress: bool = True):
        from .publish.publisher import Publisher
        from .publish.queue import PublishQueue
        from .step import VersionStats

        self.cfg = cfg
        self.audit = WorkerAudit()  # behaviour log-probs vs ours, per worker (trainer/rollouts/audit.py)
        self.publisher = Publisher(store, manifest, key, anchor_interval=cfg.train.anchor_interval,
                                   progress=progress)
        self.stats = VersionStats(store, manifest.run)
        self.publishing = PublishQueue(self.publisher, on_published=self.stats.write)
        self.ckpt_root = Path(run_dir) / "checkpoints" if run_dir is not None else None
        self.step = 0
        """Optimizer steps taken in total (including those before a resume)."""
        self.saved_step = -1
        self.saver: Any = None
        """The background checkpoint writer (trainer/checkpoint.py BackgroundSaver), made at the first save."""
        self.current: int | None = None
        """The newest version this session saw visible."""

    # -- versions ------------------------------------------------------------------------------------------
    def take_published(self) -> int | None:
        """The versions the publisher thread made visible since the last call; returns the current one."""
        self.publishing.collect()
        if self.publishing.current is not None:
            self.current = max(self.current or 0, self.publishing.current)
        return self.current

    def weights_version(self, step: int | None = None) -> int | None:
        """The published version holding exactly the weights of `step` (default: the session's), for the
        audit: the queue idle and its last publish that step's; else None."""
        last = self.publishing.last
        step = self.step if step is None else step
        return last.version if self.publishing.idle() and last is not None and last.step == step else None

    # -- the step's hand-off ---------------------------------------------------------------------------------
    def report(self, note: BatchNote | None, metrics: dict[str, Any] | None = None,
               counts: SourceCounts | None = None, step: int | None = None) -> StepReport:
        """The report of `step` (default: the session's): the note's groups, `counts` (default: the note's)."""
        counts = counts if counts is not None else note.counts if note is not None else SourceCounts(
            metrics={}, drops={}, workers={})
        return step_report(self.step if step is None else step, counts, self.audit, metrics,
                           groups=len(note.groups) if note is not None else 0)

    def hand_off(self, state, report: StepReport) -> float:
        """The step's weights to the publish queue; returns the seconds this blocked."""
        return self.publishing.submit(state, report.step, report)

    def publish_start(self, state, counts: SourceCounts, last_published: int | None = None) -> int:
        """Publish the session's first anchor now, at a version above the pointer and above the checkpoint's
        last published one; refuses to train if the publisher reused one."""
        pointer = self.publisher.current_version()
        res = self.publishing.publish_now(state, self.step, self.report(None, counts=counts), anchor=True)
        version = int(res.version)
        for before in (pointer, last_published):
            if before is not None and version <= before:
                raise RuntimeError(f"the publisher reused version {version} (pointer was {pointer}, "
                                   f"checkpoint's last published {last_published}); refusing to train")
        self.current = version
        self.publishing.collect()
        return version

    # -- checkpoints -----------------------------------------------------------------------------------------
    def resume(self, backend: Backend) -> Resumed:
        """Load the newest intact checkpoint into `backend` (trainer/checkpoint.py); the step follows it."""
        from . import checkpoint

        assert self.ckpt_root is not None, "a session without a run dir keeps no checkpoints"
        checkpoint.clean_partial(self.ckpt_root)
        found = Resumed(None, None)
        loaded = checkpoint.load_latest(self.ckpt_root, backend, found.skipped)
        if loaded is not None:
            found.path, found.state = loaded
            self.step = self.saved_step = found.state.step
        return found

    def _trainer_state(self, ledger: dict) -> TrainerState:
        from . import checkpoint

        assert self.ckpt_root is not None, "a session without a run dir keeps no checkpoints"
        return checkpoint.TrainerState(step=self.step, ledger=ledger, last_published_version=self.current,
                                       extra={"publish_failures": self.publishing.failures})

    def save(self, backend: Backend, ledger: dict) -> Path:
        """A checkpoint of the step in hand, written before this returns (after any background one completes)."""
        from . import checkpoint

        self.wait_saves()
        path = checkpoint.save(self.ckpt_root, self._trainer_state(ledger), backend,
                               keep=self.cfg.checkpoint.keep)
        self.saved_step = self.step
        return path

    def save_in_background(self, backend: Backend, ledger: dict) -> float:
        """A checkpoint of the step in hand, written by a thread while training goes on (trainer/checkpoint.py
        BackgroundSaver: the next optimizer update waits while the write still reads the state); returns the
        seconds this call blocked (the previous write's end, and the state's capture)."""
        from .checkpoint import BackgroundSaver

        if self.saver is None:
            self.saver = BackgroundSaver(backend)
        blocked = self.saver.start(self.ckpt_root, self._trainer_state(ledger), keep=self.cfg.checkpoint.keep)
        self.saved_step = self.step
        return blocked

    def wait_saves(self) -> None:
        """Until a background checkpoint is complete (raises its error)."""
        if self.saver is not None:
            self.saver.wait()

    def close(self) -> None:
        """Wait for every publish, then take what became visible."""
        self.publishing.close()
        self.take_published()
