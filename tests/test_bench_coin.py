"""The throughput benchmark's coin-flip task (bench/coin_task.py): a reward that is not constant on random
weights, scored by a real reference worker started through the bench's entry point, and unknown everywhere
else (the task registry and the plain reference worker)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.coin_task import NAME, CoinTask
from tests.worker_fixtures import publish_run, save_tiny_qwen2
from worker_contract import layout
from worker_contract.schema import decode_record
from worker_contract.store.file import FileStore
from worker_contract.tasks import TASKS, get_task

REPO = Path(__file__).resolve().parent.parent
RUN = "coin-run"
N = 4


def test_the_coin_is_deterministic_fair_and_known_only_to_the_bench():
    task = CoinTask()
    texts = [f"completion {i} {'x' * (i % 7)}" for i in range(2000)]
    rewards = [task.reward(t, task.dataset("train")[0]) for t in texts]
    assert set(rewards) == {0.0, 1.0} and 0.45 < sum(rewards) / len(rewards) < 0.55
    assert rewards == [task.reward(t, task.dataset("train")[1]) for t in texts]  # a function of the text alone
    arithmetic = get_task("arithmetic")  # same prompts and data as the arithmetic task
    assert task.messages(task.dataset("train")[3]) == arithmetic.messages(arithmetic.dataset("train")[3])
    assert NAME.startswith("bench-") and NAME not in TASKS  # importing the bench registers nothing


def _spawn(module: str, store, model_dir, *extra):
    env = {**os.environ, "PYTHONPATH": str(REPO), "DRL_N_SAMPLES": str(N), "DRL_PULSE_PLANE": "bf16"}
    return subprocess.run(
        [sys.executable, "-m", module, "--store", store.url, "--run", RUN, "--model", str(model_dir),
         "--worker-id", "w1", "--threads", "1", "--seed", "0", "--wait", "30", *extra],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def coin_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("coin")
    model_dir = save_tiny_qwen2(tmp / "model", hidden_size=32, intermediate_size=64)
    store = FileStore(tmp / "bucket")
    publish_run(store, model_dir, RUN, n_samples=N, max_new_tokens=12, task=NAME)
    return store, model_dir


def test_the_bench_worker_scores_groups_with_the_coin(coin_run):
    from transformers import AutoTokenizer

    store, model_dir = coin_run
    res = _spawn("bench.coin_task", store, model_dir, "--groups", "3")
    assert res.returncode == 0, res.stderr[-2000:]
    records = [decode_record(store.get(k)) for k in store.list_keys(layout.rollouts_prefix(RUN))]
    assert len(records) == 3 and {r.task for r in records} == {NAME}
    tok = AutoTokenizer.from_pretrained(model_dir)
    task = CoinTask()
    rewards = [s.reward for r in records for s in r.samples]
    # each sample's reward is the coin of its decoded completion, and the rewards are not all equal
    assert rewards == [task.reward(tok.decode(s.response_ids, skip_special_tokens=True), None)
                       for r in records for s in r.samples]
    assert len(set(rewards)) == 2, rewards


def test_the_plain_reference_worker_refuses_a_coin_run(coin_run):
    store, model_dir = coin_run
    res = _spawn("worker_contract.worker", store, model_dir, "--groups", "1")
    assert res.returncode == 3, res.stderr[-2000:]
    assert f"trains task {NAME!r}" in res.stderr
