"""One learner step, whatever runs the model: the spine both engines go through.

A batch from the rollout side comes with its `BatchNote` (who sampled each group, the batch's and the
source's counts). The train side audits the groups sampled at its own weights (trainer/audit.py), runs
the objective (trainer/algo.py) on the backend's micro-batches (`train_on`, native only: slime runs the
model itself), and hands the new weights to the publish queue with the step's `StepReport`, built by
`step_report` in both engines; `VersionStats` writes the stats object of the version they become.
trainer/session.py wires these parts once. Importable without torch (imported where a function needs it).
More in docs/architecture.md (module notes).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from worker_contract.schema import RolloutRecord
    from worker_contract.store import Store

    from .audit import WorkerAudit
    from .backends.base import LossFn
    from .batch import TrainBatch
    from .config import AlgoConfig
    from .publish_queue import Published, PublishQueue
    from .rollout_pool import Batch
    from .rollouts import RolloutSource


# -- what the rollout side hands the train side ---------------------------------------------------------
class SourceCounts(BaseModel):
    """The rollout source's cumulative counts at one moment."""

    model_config = ConfigDict(extra="forbid")
    metrics: dict[str, float]
    """rollout/* (accepted, dropped, drops by reason, pool) and worker/* values."""
    drops: dict[str, int]
    """Drops by reason, in total."""
    workers: dict[str, dict]
    """Per worker: groups accepted and used, drops, newest version and lag."""


class BatchNote(BaseModel):
    """What the train side needs to know of one batch besides its tensors: the audit's rows and the
    step's rollout figures. Native: it travels with the batch; slime: through trainer/slime_plugin/handoff.py."""

    model_config = ConfigDict(extra="forbid")
    current_version: int
    """The learner version the batch was assembled for."""
    groups: list[tuple[str, int]]
    """(worker id, policy version) of each group, in batch order."""
    metrics: dict[str, float]
    """The batch's own rollout/* values (reward, staleness histogram, reuse)."""
    counts: SourceCounts
    """The source's counts when the batch was taken."""


def source_counts(source: RolloutSource) -> SourceCounts:
    return SourceCounts(metrics=source.metrics(), drops=dict(source.drops), workers=source.worker_stats())


def note_batch(batch: Batch, source: RolloutSource) -> BatchNote:
    return BatchNote(current_version=batch.current_version, metrics=dict(batch.metrics),
                     groups=[(g.record.worker_id, int(g.record.policy_version)) for g in batch.groups],
                     counts=source_counts(source))


# -- the step -------------------------------------------------------------------------------------------
def loss_fn(algo: AlgoConfig) -> LossFn:
    """The objective as a backend's loss function: `algo.policy_loss` on each micro-batch."""
    from .algo import policy_loss

    def loss(logp, mb: TrainBatch):
        return policy_loss(logp, mb.behavior_logp, mb.ref_logp, mb.advantages, mb.loss_mask, algo)

    return loss


def make_batch(records: Sequence[RolloutRecord], pad_id: int = 0) -> TrainBatch:
    """Validated prompt groups -> the tensor batch, with Dr.GRPO advantages (trainer/batch.py)."""
    from .batch import collate

    return collate(records, pad_id=pad_id)


def train_on(backend, records: Sequence[RolloutRecord], algo: AlgoConfig, audit: WorkerAudit,
             weights_version: int | None) -> dict[str, float]:
    """The native step on validated groups: batch, reference log-probs, the audit of the groups sampled at
    `weights_version` (the version holding exactly the backend's weights; None when unpublished), then one
    optimizer step on the objective. Returns the backend's metrics (loss terms, fractions, grad_norm)."""
    tb = make_batch(records)
    tb.ref_logp = backend.logprobs(tb, reference=True)
    audit.audit_step(records, weights_version, lambda recs: backend.logprobs(make_batch(recs)))
    return backend.train_step(tb, loss_fn(algo))


# -- its bookkeeping, once for both engines ----------------------------------------------------------------
def step_metrics(note: BatchNote, audit: WorkerAudit, train: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A step's metrics: the model's train/* (native; slime logs its own), the batch's and the source's
    rollout/* and worker/*, the audit's worker/* and audit/*."""
    out: dict[str, Any] = {f"train/{k}": v for k, v in (train or {}).items()}
    out.update(note.metrics)
    out.update(note.counts.metrics)
    out.update(audit.metrics())
    return out


def step_report(step: int, counts: SourceCounts, audit: WorkerAudit, metrics: Mapping[str, Any] | None = None,
                groups: int = 0) -> StepReport:
    """The report handed to the publish queue with the weights of `step` (the anchor's: no metrics, no groups)."""
    return StepReport(step=step, metrics=dict(metrics or {}), drops_total={k: int(v) for k, v in counts.drops.items()},
                      workers=audit.merge_into(counts.workers), groups=groups)


def publish_metrics(queue: PublishQueue, blocking_s: float) -> dict[str, float]:
    """publish/* of a step: the newest finished publish's figures, the step's blocking time, the counters."""
    last = queue.last.stats if queue.last is not None else {}
    out = {f"publish/{k}": v for k, v in last.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    out["publish/blocking_s"] = blocking_s
    out["publish/failures"] = float(queue.failures)
    out["publish/skipped_states"] = float(queue.skipped_states)
    return out


@dataclass
class StepReport:
    """What the stats object of the version a step's weights become says about the steps since the last one."""

    step: int
    metrics: dict[str, Any]
    drops_total: dict[str, int]
    workers: dict[str, dict]
    """The source's per-worker counts, with the audit's fields merged in."""
    groups: int
    """Groups trained on since the previous published version."""

    def absorb(self, older: StepReport | None) -> None:
        """A replaced (never published) step's groups count towards this one."""
        if older is not None:
            self.groups += older.groups


class VersionStats:
    """Writes `stats/v<version>.json` for each published version: the drops since the previous one and in
    total, per-worker figures, the publish's own figures (trainer/metrics.py `version_stats`)."""

    def __init__(self, store: Store, run: str):
        self.store, self.run = store, run
        self._drops_sent: Counter[str] = Counter()

    def write(self, published: Published, report: StepReport) -> None:
        from .metrics import version_stats, write_version_stats

        drops = Counter({k: int(v) for k, v in report.drops_total.items()})
        delta = {k: v - self._drops_sent.get(k, 0) for k, v in drops.items()}
        self._drops_sent = drops
        write_version_stats(self.store, self.run, version_stats(
            version=int(published.version), step=report.step, kind=str(published.stats.get("kind", "patch")),
            metrics=report.metrics, drops_total=dict(drops), drops_delta=delta, workers=report.workers,
            groups=report.groups, publish=published.stats))
