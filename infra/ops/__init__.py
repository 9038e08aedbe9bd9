"""Operator tools that read (and, for gc, prune) a run's bucket: status, retention, cost; and the plots of a
run's metrics file.

They need only the bucket and the join card (plots: the metrics file), so they work from any laptop; the Invoke tasks that drive
them live in `infra/ops_tasks.py`.
"""
