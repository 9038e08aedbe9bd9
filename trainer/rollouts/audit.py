"""Worker audit: do a worker's recorded behaviour log-probs match what its policy version really gives?

A worker records, for every token it samples, the log-prob under the weights it sampled with. When a group
was sampled at the version whose weights the learner holds right now, the learner can recompute those
log-probs: honest workers agree up to plane rounding (bf16 / int8g64 weights on the worker, fp32 master
weights here) and kernel noise; a worker on the wrong weights or the wrong plane, or one that edits its
log-probs, does not. Per worker the audit keeps the mean |learner - recorded| over the masked tokens of its
last `window` audited groups, and flags the worker once it has `min_tokens` tokens above `threshold` nats.
More in docs/architecture.md (module notes).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker_contract.schema import RolloutRecord

#: mean |delta log-prob| per token (nats) above which a worker is flagged; honest bf16 / int8g64 workers
#: sit well below it, an edited or wrong-weights worker far above
DEFAULT_THRESHOLD = 0.25
DEFAULT_MIN_TOKENS = 64
DEFAULT_WINDOW = 32
DEFAULT_MAX_GROUPS = 2
#: per-worker audit state is kept for this many worker ids (the rest are not audited)
MAX_AUDITED_WORKERS = 4096

#: records -> per-token learner log-probs [groups*n_samples, R] at the weights being audited (no grad)
LogprobFn = Callable[[Sequence["RolloutRecord"]], Any]


@dataclass
class _Worker:
    recent: deque = field(default_factory=lambda: deque(maxlen=DEFAULT_WINDOW))
    """(sum of |delta|, tokens) of the last audited groups."""
    tokens: int = 0
    """Tokens audited in total."""
    groups: int = 0
    """Groups audited in total."""
    version: int | None = None
    """Policy version of its newest audited group: a learner that never waits for its fleet audits only
    its first step, and an old version here says so."""


class WorkerAudit:
    def __init__(self, *, threshold: float = DEFAULT_THRESHOLD, min_tokens: int = DEFAULT_MIN_TOKENS,
                 window: int = DEFAULT_WINDOW, max_groups: int = DEFAULT_MAX_GROUPS):
        for name, value, low in (("threshold", threshold, 0.0), ("min_tokens", min_tokens, 1),
                                 ("window", window, 1), ("max_groups", max_groups, 0)):
            if value < low:
                raise ValueError(f"audit {name}={value} must be at least {low}")
        self.threshold, self.min_tokens, self.window, self.max_groups = threshold, min_tokens, window, max_groups
        self._workers: dict[str, _Worker] = {}

    def pick(self, records: Sequence[RolloutRecord], weights_version: int | None) -> list[RolloutRecord]:
        """The groups to audit this step: sampled at `weights_version` (the version whose weights the learner
        holds before its step; None when it holds unpublished weights), least-audited workers first."""
        if weights_version is None or not self.max_groups:
            return []
        same = [r for r in records if r.policy_version == weights_version
                and (r.worker_id in self._workers or len(self._workers) < MAX_AUDITED_WORKERS)]
        same.sort(key=lambda r: self._workers[r.worker_id].tokens if r.worker_id in self._workers else -1)
        out, seen = [], set()
        for r in same:  # one group per worker first, then more if room is left
            if r.worker_id not in seen:
                out.append(r)
                seen.add(r.worker_id)
        picked = {id(r) for r in out}
        out += [r for r in same if id(r) not in picked]
        return out[: self.max_groups]

    def observe(self, records: Sequence[RolloutRecord], learner_logp) -> None:
        """Compare the learner's log-probs of these groups' responses (rows: sample after sample, group
        after group, as trainer.step.collate lays them out) with what the workers recorded."""
        rows = [(r.worker_id, s) for r in records for s in r.samples]
        lp = learner_logp.detach().float().cpu().tolist() if hasattr(learner_logp, "detach") else learner_logp
        assert len(lp) == len(rows), (len(lp), len(rows))
        per_group: dict[int, list[float]] = {}
        i = 0
        for g, r in enumerate(records):
            acc = per_group.setdefault(g, [0.0, 0])
            for s in r.samples:
                mine = lp[i]
                for j, (b, m) in enumerate(zip(s.behavior_logprobs, s.loss_mask, strict=True)):
                    if m:
                        acc[0] += abs(mine[j] - b)
                        acc[1] += 1
                i += 1
        for g, r in enumerate(records):
            total, n = per_group[g]
            w = self._workers.get(r.worker_id)
            if w is None:
                w = self._workers[r.worker_id] = _Worker(recent=deque(maxlen=self.window))
            w.recent.append((total, n))
            w.tokens += n
            w.groups += 1
            w.version = max(w.version or 0, r.policy_version)

    def audit_step(self, records: Sequence[RolloutRecord], weights_version: int | None,
                   logprobs: LogprobFn) -> int:
        """Pick, recompute and observe in one call; returns how many groups were audited."""
        chosen = self.pick(records, weights_version)
        if chosen:
            self.observe(chosen, logprobs(chosen))
        return len(chosen)

    # -- results -----------------------------------------------------------------------------------------
    def mismatch(self, worker: str) -> float | None:
        w = self._workers.get(worker)
        if w is None:
            return None
        total = sum(t for t, _ in w.recent)
        n = sum(k for _, k in w.recent)
        return total / n if n else None

    def flagged(self, worker: str) -> bool:
        w = self._workers.get(worker)
        m = self.mismatch(worker)
        return w is not None and m is not None and sum(k for _, k in w.recent) >= self.min_tokens \
            and m > self.threshold

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per audited worker: logprob_mismatch (nats per token, recent window), flagged, audited tokens and
        groups, and the policy version of its newest audited group."""
        out = {}
        for wid, w in self._workers.items():
            m = self.mismatch(wid)
            out[wid] = {"logprob_mismatch": m, "flagged": self.flagged(wid), "audited_tokens": w.tokens,
                        "audited_groups": w.groups, "audited_version": w.version}
        return out

    def metrics(self) -> dict[str, float]:
        m: dict[str, float] = {}
        for wid, s in self.stats().items():
            if s["logprob_mismatch"] is not None:
                m[f"worker/{wid}/logprob_mismatch"] = float(s["logprob_mismatch"])
            m[f"worker/{wid}/flagged"] = float(s["flagged"])
            m[f"worker/{wid}/audited_tokens"] = float(s["audited_tokens"])
        m["audit/flagged_workers"] = float(sum(s["flagged"] for s in self.stats().values()))
        return m

    def merge_into(self, workers: dict[str, dict]) -> dict[str, dict]:
        """The source's per-worker stats with the audit's fields added (for the bucket stats object)."""
        out = {w: dict(s) for w, s in workers.items()}
        for wid, s in self.stats().items():
            out.setdefault(wid, {}).update(s)
        return out
