"""The rollout side: the bucket-backed source (source.py) and the pool that judges, keeps and batches
the groups it reads (pool.py). `trainer.rollouts` hands on the source's names, as it did as one module."""

from .pool import DROP_REASONS, Batch, Group, GroupPool
from .source import RolloutSource

__all__ = ["DROP_REASONS", "Batch", "Group", "GroupPool", "RolloutSource"]
