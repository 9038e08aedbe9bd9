"""One learner step, whatever runs the model: the spine both engines go through.

A step turns validated groups (trainer/rollouts.py) into a batch with Dr.GRPO advantages
(trainer/batch.py), audits the workers whose groups were sampled at the learner's own weights
(trainer/audit.py), runs the objective (trainer/algo.py) in the backend's micro-batches, and hands the new
weights to the publisher (trainer/publish_queue.py) with the stats of the version they become
(`VersionStats`, the bucket's stats/v<version>.json). Only "run the model" differs between engines:

- native (trainer/learner.py, backends hf and megatron): `Spine.train` runs all of it;
- slime (trainer/slime_plugin/): slime runs the model and its own loop; its hooks call the same pieces:
  the rollout function takes batches from the same source, the reward hook `algo.group_advantages`, the
  loss hooks `algo`'s gate and reducer (slime's own dual-clip and k3 KL complete `algo.policy_loss`,
  tests/test_engines_agree.py), the log-prob hook `StepAudit`, and the after-train hook `Spine.publish`'s
  queue and `VersionStats`.

Importable without torch (torch is imported where a function needs it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker_contract.schema import RolloutRecord

    from .backends.base import LossFn
    from .batch import TrainBatch
    from .config import AlgoConfig


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
