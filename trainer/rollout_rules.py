"""What makes a rollout record usable: the run's contract and the staleness window, checked record by record.

Every record a worker writes is judged here before the learner sees it; a bad one gets one of
DROP_REASONS (counted as `rollout/drops/<reason>`, never raised). The rules are the run's published
contract (run.json: group size, plane, vocabulary, sampling) plus the recipe's staleness bound. Pure
checks, no I/O: the listing lives in trainer/rollouts.py, the pool and its reuse ledger in
trainer/rollout_pool.py. Importable without torch or Ray.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from worker_contract import layout
from worker_contract.schema import MAX_RECORD_BYTES, RolloutRecord

if TYPE_CHECKING:
    from worker_contract.manifest import RunManifest

    from .config import AlgoConfig

#: every reason a record can be dropped for, with what it means (the metric is rollout/drops/<reason>)
DROP_REASONS: dict[str, str] = {
    "bad_key": "the key does not parse as <run>/rollouts/v<version>/<worker>/<group>.json.zst",
    "oversized": "object larger than the record size limit",
    "malformed": "not zstd, not JSON, does not follow the record schema, or has an empty prompt",
    "schema_version": "a record format this learner does not read",
    "length_mismatch": "response tokens, log-probs and loss mask differ in length",
    "wrong_run": "the record names another run",
    "future_version": "sampled by a policy version newer than the newest published one",
    "stale": "sampled more than `staleness` versions ago (never used before it aged out)",
    "key_mismatch": "version, worker or group in the key differs from the record",
    "wrong_plane": "sampled on another weight plane (DRL_PULSE_PLANE)",
    "group_size": "group size differs from DRL_N_SAMPLES",
    "sampling_mismatch": "temperature, top_p or max_new_tokens differs from the run's",
    "vocab": "a token id outside [0, vocab_size)",
    "too_long": "a response longer than max_new_tokens (the budget covers sampled and tool tokens)",
    "logprob_not_finite": "a behaviour log-prob is NaN or infinite",
    "logprob_positive": "a behaviour log-prob is above 0 (a probability above 1)",
    "reward_not_finite": "a reward is NaN or infinite",
    "duplicate": "the same worker/group id under a second key",
    "reuse_cap": "the group was already used `reuse_cap` times",
    "vanished": "listed, then gone before it could be read",
}
#: log-probs up to this far above 0 are rounding noise of the worker's softmax, not an error
LOGPROB_POSITIVE_TOL = 1e-4


@dataclass(frozen=True)
class RecordRules:
    """The contract a record must follow to be trained on, and the staleness window it must fall in."""

    run: str
    n_samples: int
    plane: str
    vocab_size: int
    temperature: float
    top_p: float
    max_new_tokens: int
    staleness: int
    max_record_bytes: int = MAX_RECORD_BYTES

    def __post_init__(self) -> None:
        layout.check_run_id(self.run)
        for name, low in (("staleness", 0), ("n_samples", 1), ("vocab_size", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"{name}={getattr(self, name)} must be at least {low}")

    @classmethod
    def from_manifest(cls, manifest: RunManifest, algo: AlgoConfig, **kw) -> RecordRules:
        """The run's published contract (run.json) and the recipe's staleness bound."""
        return cls(run=manifest.run, n_samples=manifest.n_samples, plane=manifest.plane,
                   vocab_size=manifest.vocab_size, temperature=manifest.temperature, top_p=manifest.top_p,
                   max_new_tokens=manifest.max_new_tokens, staleness=algo.staleness, **kw)

    def window(self, current: int) -> range:
        """Policy versions a record may carry when the learner is at `current`."""
        return range(max(1, current - self.staleness), current + 1)

    def check(self, rec: RolloutRecord, key: layout.RolloutKey, current: int) -> str | None:
        """The drop reason for a decoded record, or None if the learner may use it."""
        if rec.run != self.run or key.run != self.run:
            return "wrong_run"
        if rec.policy_version > current:
            return "future_version"
        if current - rec.policy_version > self.staleness:
            return "stale"
        if (key.version, key.worker_id, key.group_id) != (rec.policy_version, rec.worker_id, rec.group_id):
            return "key_mismatch"
        if rec.plane != self.plane:
            return "wrong_plane"
        if len(rec.samples) != self.n_samples:
            return "group_size"
        sp = rec.sampling
        if (not math.isclose(sp.temperature, self.temperature, rel_tol=1e-6) or
                not math.isclose(sp.top_p, self.top_p, rel_tol=1e-6) or sp.max_new_tokens != self.max_new_tokens):
            return "sampling_mismatch"
        if not rec.prompt_ids:
            return "malformed"  # nothing would predict the first response token
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t in rec.prompt_ids):
            return "vocab"
        for s in rec.samples:
            if len(s.response_ids) > self.max_new_tokens:
                return "too_long"  # a hostile length would otherwise reach the learner's forward
            if any(not 0 <= t < vocab for t in s.response_ids):
                return "vocab"
            if len(s.behavior_logprobs) != len(s.response_ids):
                return "length_mismatch"
            if not all(math.isfinite(x) for x in s.behavior_logprobs):
                return "logprob_not_finite"
            if any(x > LOGPROB_POSITIVE_TOL for x in s.behavior_logprobs):
                return "logprob_positive"
            if not math.isfinite(s.reward):
                return "reward_not_finite"
        return None
