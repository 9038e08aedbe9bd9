"""The MLX worker refuses in one sentence (exit 2), before fetching any weights, to start where the memory
it may use (the machine's, or DRL_WORKER_MEMORY_GB) cannot hold the model, its published plane, a patch's
result and the KV cache of its batch; a DRL_WORKER_MEMORY_GB that is no positive number is refused the same
way; the estimate grows with the batch and the budget as the shapes say."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.test_mlx_worker import REPO, RUN, N, _publish_run, tiny_model_dir  # noqa: F401
from worker_contract import layout
from worker_contract.store.file import FileStore

mx = pytest.importorskip("mlx.core", reason="the MLX worker needs mlx (mlx[cpu] on Linux)")


def _run(store, model_dir, memory_gb: str):
    env = {**os.environ, "PYTHONPATH": str(REPO), "DRL_N_SAMPLES": str(N), "DRL_PULSE_PLANE": "int8g64",
           "DRL_WORKER_MEMORY_GB": memory_gb}
    return subprocess.run([sys.executable, "-m", "worker_contract.worker", "--backend", "mlx", "--store", store.url,
                           "--run", RUN, "--model", str(model_dir), "--worker-id", "m", "--groups", "1"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("memory_gb,needle", [
    ("0.001", "of memory and the MLX worker needs about"),
    ("lots", "DRL_WORKER_MEMORY_GB='lots' is not a positive number of GB"),
    ("-3", "DRL_WORKER_MEMORY_GB='-3' is not a positive number of GB"),
])
def test_a_worker_that_cannot_hold_the_model_refuses_in_one_sentence(tmp_path, tiny_model_dir, memory_gb, needle):  # noqa: F811
    store = FileStore(tmp_path / "bucket")
    _publish_run(store, tiny_model_dir, "int8g64")
    p = _run(store, tiny_model_dir, memory_gb)
    assert p.returncode == 2, p.stderr
    err = [ln for ln in p.stderr.splitlines() if "worker error" in ln]
    assert len(err) == 1 and needle in err[0] and "Traceback" not in p.stderr, p.stderr
    assert store.list_keys(layout.rollouts_prefix(RUN)) == []


def test_the_estimate_follows_the_shapes(tiny_model_dir):  # noqa: F811
    from worker_contract.worker.memory import worker_memory
    from worker_contract.worker.mlx_model import build_model

    model, _, cfg = build_model(tiny_model_dir)
    one = worker_memory(model, cfg, plane="int8g64", dtype="bfloat16", n_samples=8, max_new_tokens=100)
    two = worker_memory(model, cfg, plane="int8g64", dtype="bfloat16", n_samples=8, max_new_tokens=100, groups=2)
    bf = worker_memory(model, cfg, plane="bf16", dtype="bfloat16", n_samples=8, max_new_tokens=100)
    assert two["kv_cache"] == 2 * one["kv_cache"] > 0 and two["weights"] == one["weights"]
    assert bf["plane_copy"] > one["plane_copy"]  # int8g64: a byte and 1/16 of a scale/bias pair per weight
