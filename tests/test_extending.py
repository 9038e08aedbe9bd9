"""docs/extending.md kept true: a toy single-turn task and a toy weight plane, each written as its own module in a
temporary folder with a recipe beside them, registered from there, then run through one real loop (a run
published in the toy plane, the reference worker sampling the toy task, the learner's source, one optimizer step
of the objective, a patch in the toy plane followed by the worker's reconstruction). No file of the repository
is edited: a registry that some code bypasses (a name list, an if-chain over names) fails here.
"""

from __future__ import annotations

import sys
import textwrap
import threading

import numpy as np
import pytest

from tests.worker_fixtures import save_tiny_qwen2

torch = pytest.importorskip("torch")

TOY_TASK = '''
"""A toy single-turn task: answer a number's parity with the parity of the reply's length (a random policy
scores about half, so the step has a gradient)."""
from worker_contract.tasks import Problem, Task, register_task


@register_task
class ParityTask(Task):
    name = "toy-parity"
    heldout_label = "held-out parity accuracy"

    def dataset(self, split):
        base = 0 if split == "train" else 1000
        return [Problem(id=f"toy-{split}-{i}", question=f"Is {base + i} even?", answer="yes" if i % 2 == 0 else "no")
                for i in range(16)]

    def messages(self, problem):
        return [{"role": "user", "content": problem.question}]

    def extract_answer(self, completion):
        return "yes" if len(completion) % 2 == 0 else "no"

    def reward(self, completion, problem):
        return 1.0 if self.extract_answer(completion) == problem.answer else 0.0

    def batch_metrics(self, samples):
        return {"rollout/toy_samples": float(len(samples))}
'''

TOY_PLANE = '''
"""A toy weight plane: every floating tensor as float16 under its HF name."""
import numpy as np

from worker_contract.planes import register_plane
from worker_contract.tensors import to_numpy

NAME = "toy-fp16"


def from_hf(state):
    out = {}
    for name in sorted(state):
        a = to_numpy(state[name].detach().float()) if hasattr(state[name], "detach") else np.asarray(state[name])
        out[name] = a.astype(np.float16) if a.dtype.kind == "f" or a.dtype.name == "bfloat16" else a
    return out


def from_hf_torch(state):
    import torch

    return {name: (state[name].detach().float().to(torch.float16) if state[name].is_floating_point()
                   else state[name].detach().clone()).contiguous() for name in sorted(state)}


def to_dense(plane_state):
    return {name: to_numpy(x) for name, x in plane_state.items()}


def quantized_tensors(plane_state):
    return []


register_plane(__import__(__name__))
'''

TOY_RECIPE = '''
name: toy
task: toy-parity
contract: {n_samples: 4, plane: toy-fp16}
model: {dtype: float32}
algo: {groups_per_step: 2, max_new_tokens: 8, lr: 1.0e-3, temperature: 1.0}
train: {backend: hf, micro_batch_size: 8, max_tokens_per_gpu: null}
'''

RUN = "toy-ext-1"


@pytest.fixture
def toy_folder(tmp_path, monkeypatch):
    """The three files of the extension (task module, plane module, recipe), imported from their folder; the
    registries are put back afterwards."""
    from worker_contract.planes import PLANES
    from worker_contract.tasks import TASKS

    ext = tmp_path / "ext"
    ext.mkdir()
    (ext / "toy_task.py").write_text(textwrap.dedent(TOY_TASK))
    (ext / "toy_plane.py").write_text(textwrap.dedent(TOY_PLANE))
    (ext / "toy.yaml").write_text(textwrap.dedent(TOY_RECIPE))
    monkeypatch.syspath_prepend(str(ext))
    tasks, planes = dict(TASKS), dict(PLANES)
    import toy_plane  # noqa: F401  (registers itself)
    import toy_task  # noqa: F401
    yield ext
    TASKS.clear(), TASKS.update(tasks)
    PLANES.clear(), PLANES.update(planes)
    for name in ("toy_task", "toy_plane"):
        sys.modules.pop(name, None)


def test_a_toy_task_and_a_toy_plane_from_a_folder_run_through_the_loop(toy_folder, tmp_path):
    from transformers import AutoModelForCausalLM

    from trainer.backends import get_backend
    from trainer.config import resolve
    from trainer.models.identity import identity_from_hf
    from trainer.publish.publisher import Publisher
    from trainer.rollouts.pool import BatchRules, RecordRules
    from trainer.rollouts.source import RolloutSource
    from trainer.run_init import run_manifest
    from trainer.step import loss_fn, make_batch
    from worker_contract import signing
    from worker_contract.manifest import create_or_resume
    from worker_contract.planes import get_plane
    from worker_contract.reconstruct import Reconstructor
    from worker_contract.store import open_store
    from worker_contract.tasks import get_task
    from worker_contract.tensors import words
    from worker_contract.worker.loop import Worker, WorkerSettings

    model_dir = save_tiny_qwen2(tmp_path / "model", hidden_size=32, intermediate_size=64)
    cfg = resolve(str(toy_folder / "toy.yaml"), env={}, overrides={"run": RUN, "model.path": str(model_dir)})
    assert (cfg.task, cfg.contract.plane) == ("toy-parity", "toy-fp16")
    assert get_task(cfg.task).heldout_label == "held-out parity accuracy" and not get_task(cfg.task).multi_turn

    # the trainer: run.json and the v1 anchor, in the toy plane
    store = open_store(f"file://{tmp_path / 'bucket'}")
    key = signing.generate_private_key()
    manifest = create_or_resume(store, run_manifest(cfg, identity_from_hf(model_dir), signing.public_key_b64(key)),
                                resume=False)
    pub = Publisher(store, manifest, key, anchor_interval=10, progress=False, encoder="torch")  # the torch twin
    assert pub.publish_anchor(AutoModelForCausalLM.from_pretrained(model_dir).state_dict()).version == 1

    # the reference worker joins in the toy plane and samples the toy task
    settings = WorkerSettings(store=store.url, run=RUN, model_dir=str(model_dir), worker_id="w1", seed=0, threads=1,
                              max_groups=2)
    stats = Worker(settings, env={"DRL_N_SAMPLES": "4", "DRL_PULSE_PLANE": "toy-fp16"}).run(threading.Event())
    assert stats.groups == 2

    # the learner: its source validates the records, the task's own metrics join the batch's
    source = RolloutSource(store, RecordRules.from_manifest(manifest, cfg.algo),
                           BatchRules(cfg.algo.groups_per_step, cfg.algo.reuse_cap))
    assert source.poll(1) == 2
    batch = source.take_batch(1)
    assert batch is not None and batch.metrics["rollout/toy_samples"] == 8.0
    records = [g.record for g in batch.groups]
    assert {r.task for r in records} == {"toy-parity"} and {r.plane for r in records} == {"toy-fp16"}

    # one optimizer step of the recipe's objective, published as a patch in the toy plane
    backend = get_backend(cfg.train.backend).load(model_dir, cfg, device="cpu")
    tb = make_batch(records)
    tb.ref_logp = backend.logprobs(tb, reference=True)
    metrics = backend.train_step(tb, loss_fn(cfg.algo))
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    state = backend.state_dict_hf()
    assert pub.publish(state).version == 2

    # a worker following the run reconstructs exactly the toy plane of the new weights
    version, got = Reconstructor(store, RUN, plane="toy-fp16").join()
    want = get_plane("toy-fp16").from_hf(state)
    assert version == 2 and set(got) == set(want)
    for name in want:
        assert got[name].dtype == np.float16 or got[name].dtype == want[name].dtype, name
        assert np.array_equal(words(got[name]), words(want[name])), name


def test_a_task_module_in_the_tasks_package_is_found_by_its_name(tmp_path, monkeypatch):
    """A task shipped in worker_contract/tasks/ is its module alone: named after the task, it registers itself
    when the name is first asked for (the folder is put on the package's path here; no repository file is
    edited). An unknown name is still refused with the known ones."""
    import worker_contract.tasks as tasks

    (tmp_path / "toy_found.py").write_text(textwrap.dedent('''
        from worker_contract.tasks import register_task
        from worker_contract.tasks.arithmetic import ArithmeticTask


        @register_task
        class Found(ArithmeticTask):
            name = "toy-found"
    '''))
    monkeypatch.setattr(tasks, "__path__", [*tasks.__path__, str(tmp_path)])
    try:
        assert "toy-found" not in tasks.TASKS and tasks.is_task("toy-found")
        assert tasks.get_task("toy-found").name == "toy-found"
        with pytest.raises(ValueError, match="unknown task 'toy-lost'; known tasks: arithmetic"):
            tasks.get_task("toy-lost")
    finally:
        tasks.TASKS.pop("toy-found", None)
        sys.modules.pop("worker_contract.tasks.toy_found", None)
