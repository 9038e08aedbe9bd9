"""Invoke tasks: an index. Each task lives with the code it drives (infra/, trainer/); this file only
assembles the namespace. `invoke --list` shows them; every task that changes a machine or a bucket has
--dry-run, names what it will touch and asks first (--yes for scripts), and `status` is read-only. All are
built with infra.taskkit.stoa_task: no short flags, bad input is one sentence and exit 2.
"""

from invoke import Collection

ns = Collection()

from infra import contract_tasks  # noqa: E402  (the worker contract: joincard)

ns.add_task(contract_tasks.joincard)

from infra import ops_tasks  # noqa: E402  (operator view: status, plot, gc, preflight)

for _t in (ops_tasks.status, ops_tasks.plot, ops_tasks.gc, ops_tasks.preflight):
    ns.add_task(_t)

from infra import retriever_tasks  # noqa: E402  (BM25 retriever for the PaperSearchQA fleet)

ns.add_collection(retriever_tasks.ns)

from infra import convert_tasks  # noqa: E402  (HF -> Megatron torch_dist conversion)

ns.add_task(convert_tasks.convert)

from infra import remote_tasks  # noqa: E402  (the trainer box of a run: logs, stop, teardown)

for _t in (remote_tasks.logs, remote_tasks.stop, remote_tasks.teardown):
    ns.add_task(_t)
