"""The rollout side: the bucket-backed source (source.py) and the pool that judges, keeps and batches
the groups it reads (pool.py)."""
