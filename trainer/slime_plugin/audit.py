"""`--rollout-data-postprocess-path trainer.slime_plugin.audit.audit_rollout_data`: the worker audit in slime.

slime calls the hook on every train rank after it recomputed the policy's log-probs of the step's samples
and before it trains; the same trainer.rollouts.audit.WorkerAudit the native learner runs then compares each audited
worker's recorded log-probs with the learner's, under the same metric names.
More in docs/slime.md (module notes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .context import PluginContext, context


@dataclass
class _Sample:
    behavior_logprobs: list[float]
    loss_mask: list[int]


@dataclass
class _Group:
    """The part of a rollout record the audit reads (trainer/rollouts/audit.py)."""

    worker_id: str
    policy_version: int
    samples: list[_Sample]


def weights_version(ctx: PluginContext, rollout_id: int) -> int | None:
    """The version holding exactly the actor's weights before it trains on `rollout_id`: the one the
    after-train hook of `rollout_id - 1` published (step `rollout_id`), once visible and nothing after it."""
    session = ctx.started_session()
    return None if session is None else session.weights_version(rollout_id)


def audit_rollout_data(args: Any, rollout_id: int, rollout_data: dict) -> int:
    """slime's rollout-data post-process hook; returns how many groups were audited on this rank."""
    ctx = context()
    version = weights_version(ctx, rollout_id)
    if version is None or "log_probs" not in rollout_data:
        return 0
    note = ctx.note_for(rollout_id)
    if note is None:
        return 0
    n = ctx.manifest.n_samples
    here = {int(idx): i for i, idx in enumerate(rollout_data.get("sample_indices") or [])}
    groups, logps = [], {}
    for gi, (worker, policy_version) in enumerate(note.groups):
        pos = [here.get(gi * n + j) for j in range(n)]
        if any(p is None for p in pos):  # not all of the group is on this rank
            continue
        samples = [_Sample([float(x) for x in rollout_data["rollout_log_probs"][p].tolist()],
                           [int(x) for x in rollout_data["loss_masks"][p].tolist()]) for p in pos]
        groups.append(_Group(worker, int(policy_version), samples))
        logps[id(groups[-1])] = [rollout_data["log_probs"][p].detach().float().cpu().tolist() for p in pos]
    # slime recomputed the log-probs already: the audit's recompute reads them
    return ctx.session().audit.audit_step(groups, version, lambda chosen: [row for g in chosen for row in logps[id(g)]])
