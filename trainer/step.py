"""One learner step, whatever runs the model: the spine both engines go through.

`collate` lays a batch's prompt groups out as one `TrainBatch` (prompt then response, right-padded, with
Dr.GRPO advantages). A batch comes with its `BatchNote` (who sampled each group, the batch's and the
source's counts). The train side audits the groups sampled at its own weights (trainer/rollouts/audit.py), runs the
objective (trainer/algo.py) on the backend's micro-batches (`train_on`, native only: slime runs the model
itself), and hands the new weights to the publish queue with the `StepReport` that `step_report` builds
in both engines. trainer/session.py wires these parts once. Importable without torch (imported where a
function needs it). More in docs/architecture.md (module notes).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from worker_contract.schema import RolloutRecord

if TYPE_CHECKING:
    import torch

    from worker_contract.routes import RouteShape
    from worker_contract.store import Store

    from .config import AlgoConfig
    from .publish.queue import Published, PublishQueue
    from .rollouts.audit import WorkerAudit
    from .rollouts.pool import Batch
    from .rollouts.source import RolloutSource


# -- the tensor batch: prompt groups laid out for a forward pass over prompt + response ------------------
@dataclass
class TrainBatch:
    input_ids: torch.Tensor
    """[B, T] int64: prompt then response tokens, right-padded with pad_id."""
    attention_mask: torch.Tensor
    """[B, T] int64: 1 on real tokens."""
    prompt_lens: torch.Tensor
    """[B] int64: prompt length of each row (at least 1)."""
    response_lens: torch.Tensor
    """[B] int64: response length of each row."""
    loss_mask: torch.Tensor
    """[B, R] float: 1 where the token is trained on (the record's loss mask), 0 on padding."""
    behavior_logp: torch.Tensor
    """[B, R] float: log-probs the worker recorded when it sampled each token."""
    advantages: torch.Tensor
    """[B] float: Dr.GRPO advantage of each row."""
    rewards: torch.Tensor
    """[B] float: raw rewards."""
    ref_logp: torch.Tensor | None = None
    """[B, R] float: reference-policy log-probs, filled in by the learner before the step."""
    routes: torch.Tensor | None = None
    """[B, T, layers, top_k] int16: the experts the worker routed each token to, -1 where the record has
    none (padding, the tokens after the last trained one); None unless the run replays routes."""

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_response(self) -> int:
        return int(self.loss_mask.shape[1])

    def to(self, device: torch.device | str) -> TrainBatch:
        import torch

        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return TrainBatch(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in moved.items()})

    def micro_batches(self, rows: int, max_tokens: int | None = None) -> list[TrainBatch]:
        """Consecutive rows in micro-batches of at most `rows` rows and, when `max_tokens` is given, at most
        that many padded tokens (rows x their longest sequence; a longer single row still goes alone)."""
        lengths = (self.prompt_lens + self.response_lens).tolist()
        out, start, longest = [], 0, 0
        for i, n in enumerate(lengths):
            longest = max(longest, int(n))
            count = i - start + 1
            if i > start and (count > rows or (max_tokens is not None and count * longest > max_tokens)):
                out.append(self.select(start, i))
                start, longest = i, int(n)
        if lengths:
            out.append(self.select(start, len(lengths)))
        return out

    def select(self, start: int, stop: int) -> TrainBatch:
        """Rows [start, stop), trimmed to the longest sequence and response among them (a micro-batch)."""
        t = int((self.prompt_lens[start:stop] + self.response_lens[start:stop]).max())
        r = max(int(self.response_lens[start:stop].max()), 1)

        def cut(x: torch.Tensor | None, width: int) -> torch.Tensor | None:
            return None if x is None else x[start:stop, :width]

        return replace(
            self,
            input_ids=cut(self.input_ids, t), attention_mask=cut(self.attention_mask, t),
            prompt_lens=self.prompt_lens[start:stop], response_lens=self.response_lens[start:stop],
            loss_mask=cut(self.loss_mask, r), behavior_logp=cut(self.behavior_logp, r),
            advantages=self.advantages[start:stop], rewards=self.rewards[start:stop],
            ref_logp=cut(self.ref_logp, r), routes=cut(self.routes, t),
        )

    def response_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row, column j, position of the logits that predict it) for every response token."""
        import torch

        r = self.max_response
        j = torch.arange(r, device=self.input_ids.device).expand(self.rows, r)
        valid = j < self.response_lens.unsqueeze(1)
        rows, cols = valid.nonzero(as_tuple=True)
        pos = self.prompt_lens[rows] + cols - 1
        return rows, cols, pos


def collate(records: Sequence[RolloutRecord], pad_id: int = 0, routes: RouteShape | None = None) -> TrainBatch:
    """Lay out prompt groups as one batch; advantages are computed per group (Dr.GRPO). With `routes` (the
    model's route shape, when the run replays routes) the records' routes come along (`TrainBatch.routes`)."""
    import torch

    from .algo import group_advantages

    if not records:
        raise ValueError("collate needs at least one prompt group")
    n = len(records[0].samples)
    if any(len(r.samples) != n for r in records):
        raise ValueError("every group of a batch must have the same size (DRL_N_SAMPLES)")
    if any(not r.prompt_ids for r in records):
        raise ValueError("a prompt group with an empty prompt cannot be trained on (nothing predicts token 0)")
    flat = [s.reward for r in records for s in r.samples]
    rewards = torch.tensor(flat, dtype=torch.float32)
    adv = torch.tensor(group_advantages(flat, n), dtype=torch.float32)
    rows = [(r.prompt_ids, s) for r in records for s in r.samples]
    b = len(rows)
    t = max(len(p) + len(s.response_ids) for p, s in rows)
    rmax = max(max(len(s.response_ids) for _, s in rows), 1)
    input_ids = torch.full((b, t), pad_id, dtype=torch.long)
    attn = torch.zeros((b, t), dtype=torch.long)
    loss_mask = torch.zeros((b, rmax), dtype=torch.float32)
    blp = torch.zeros((b, rmax), dtype=torch.float32)
    for i, (prompt, s) in enumerate(rows):
        seq = list(prompt) + list(s.response_ids)
        input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attn[i, : len(seq)] = 1
        k = len(s.response_ids)
        if k:
            loss_mask[i, :k] = torch.tensor(s.loss_mask, dtype=torch.float32)
            blp[i, :k] = torch.tensor(s.behavior_logprobs, dtype=torch.float32)
    return TrainBatch(
        input_ids=input_ids, attention_mask=attn,
        prompt_lens=torch.tensor([len(p) for p, _ in rows], dtype=torch.long),
        response_lens=torch.tensor([len(s.response_ids) for _, s in rows], dtype=torch.long),
        loss_mask=loss_mask, behavior_logp=blp, advantages=adv, rewards=rewards,
        routes=None if routes is None else route_tensor(records, routes, t),
    )


def route_tensor(records: Sequence[RolloutRecord], shape: RouteShape, width: int) -> torch.Tensor:
    """[rows, width, layers, top_k] int16 of the records' routes (collate's row order), -1 where none."""
    import numpy as np
    import torch

    from worker_contract.routes import decode_routes

    n = sum(len(r.samples) for r in records)
    out = np.full((n, width, shape.layers, shape.top_k), -1, dtype=np.int16)
    row = 0
    for rec in records:
        prompt, samples = decode_routes(rec, shape)  # checked when the record was pooled
        p = len(prompt)
        for resp in samples:
            out[row, :p] = prompt
            out[row, p:p + len(resp)] = resp
            row += 1
    return torch.from_numpy(out)


#: what the step hands a backend: (per-token log-probs of a micro-batch, the micro-batch) -> (loss, metrics)
LossFn = Callable[["torch.Tensor", TrainBatch], tuple["torch.Tensor", dict[str, float]]]



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
    """The objective as a backend's loss function: `objectives.objective_loss` on each micro-batch's `LossInputs`."""
    from .objectives import LossInputs, objective_loss

    def loss(logp, mb: TrainBatch):
        return objective_loss(LossInputs.make(logp, mb.behavior_logp, mb.ref_logp, mb.advantages, mb.loss_mask),
                              algo)

    return loss


#: validated prompt groups -> the tensor batch, with Dr.GRPO advantages: `collate`, under the step's name for it
make_batch = collate


def train_on(backend, records: Sequence[RolloutRecord], algo: AlgoConfig, audit: WorkerAudit,
             weights_version: int | None) -> dict[str, float]:
    """The native step on validated groups: batch, reference log-probs, the audit of the groups sampled at
    `weights_version` (the version holding exactly the backend's weights; None when unpublished), then one
    optimizer step on the objective. Returns the backend's metrics (loss terms, fractions, grad_norm)."""
    shape = backend.route_shape if algo.routing_replay else None
    tb = make_batch(records, routes=shape)
    tb.ref_logp = backend.logprobs(tb, reference=True)
    audit.audit_step(records, weights_version, lambda recs: backend.logprobs(make_batch(recs, routes=shape)))
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
