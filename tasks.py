"""Invoke tasks: an index. Each task lives with the code it drives (infra/, trainer/); this file only
assembles the namespace. `invoke --list` shows them; every task that changes a machine or a bucket has
--dry-run, and `status` is read-only.
"""

from invoke import Collection

ns = Collection()
