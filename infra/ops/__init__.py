"""Operator tools that read (and, for gc, prune) a run's bucket: status, retention, cost.

They need only the bucket and the join card, so they work from any laptop; the Invoke tasks that drive
them live in `infra/ops_tasks.py`.
"""
