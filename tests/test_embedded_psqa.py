"""The embedded psqa run (`make psqa RUN=<id>` with no HOST, GPU or R2): the search metrics the learner's rows
carry, read off the records (fast); and (slow lane) a short loop with real processes: the retriever on
127.0.0.1, one torch and one MLX worker, the native learner, held-out cover-EM with its search rate, verify
ok, then a resumed session stopped by Ctrl-C with every process gone. The dry run is in tests/test_launch.py.
"""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from test_embedded_e2e import _leftovers, _verify, _wait_gone  # the gsm8k loop's run checks

from embedded.config import resolve_embedded
from trainer.rollouts.pool import BatchRules, GroupPool, Tally
from worker_contract import layout
from worker_contract.schema import RolloutRecord, Sample, SamplingParams
from worker_contract.tasks import get_task

REPO = Path(__file__).resolve().parent.parent


def _sample(reward: float, searched: bool) -> Sample:
    mask = [1, 1, 0, 0, 1] if searched else [1, 1, 1]  # a tool turn is a mask-0 span
    return Sample(response_ids=list(range(len(mask))), behavior_logprobs=[-0.5 if m else 0.0 for m in mask],
                  loss_mask=mask, reward=reward, finish_reason="stop")


def _record(i: int, task: str, samples: list[Sample]) -> RolloutRecord:
    return RolloutRecord(run="r", worker_id="w", group_id=f"g{i}", policy_version=1, plane="int8g64", task=task,
                         prompt_id=f"p{i}", prompt_ids=[1, 2], samples=samples, created_at=0.0,
                         sampling=SamplingParams(temperature=1.0, max_new_tokens=8))


def _batch_metrics(task: str, groups: list[list[Sample]]) -> dict[str, float]:
    pool = GroupPool(BatchRules(len(groups), 2), lambda c: range(max(1, c - 3), c + 1), Tally(), 3, get_task(task))
    for i, samples in enumerate(groups):
        assert pool.admit(layout.rollout_key("r", 1, "w", f"g{i}"), _record(i, task, samples), "w") is None
    return pool.take(1).metrics


def test_a_psqa_batch_reports_its_search_rate_and_the_correct_answers_found_after_a_search():
    m = _batch_metrics("psqa", [[_sample(1.0, True), _sample(0.0, True), _sample(1.0, False), _sample(0.0, False)],
                                [_sample(1.0, True), _sample(0.0, False), _sample(0.0, False), _sample(0.0, False)]])
    assert m["rollout/search_rate"] == 3 / 8
    assert m["rollout/correct_after_search"] == 2 / 3  # 3 correct, 2 of them searched
    assert "rollout/search_rate" not in _batch_metrics("gsm8k", [[_sample(1.0, False)] * 4])


def _run(root: Path, run: str, model: Path, **over) -> tuple[int, str]:
    from rich.console import Console

    from embedded.run import run_embedded

    tiny = {"run": run, "model.path": str(model), "algo.groups_per_step": 2, "algo.max_new_tokens": 48,
            "embedded.eval_every": 2, "embedded.eval_problems": 6, "embedded.psqa.entities": 300,
            "embedded.psqa.heldout_entities": 30, "train.save_interval": 2}
    cfg = resolve_embedded("psqa", env={}, overrides={**tiny, **over})
    buf = io.StringIO()
    rc = run_embedded(cfg, console=Console(file=buf, width=160), root=root)
    return rc, buf.getvalue()


@pytest.mark.slow
def test_embedded_psqa_loop_with_real_processes_then_resume_and_ctrl_c(tmp_path):
    """Two learner steps on a tiny random LFM2-MoE (MODEL=: the base build has its own tests), every process
    real: the retriever serves the generated corpus on loopback, both backends upload search episodes, the
    held-out rows carry cover-EM and the search rate; verify ok. A second session resumes and Ctrl-C ends it."""
    from episode_fixtures import save_search_model

    model = save_search_model(tmp_path / "model", "lfm2_moe")
    run = "psqa-e2e"
    rc, out = _run(tmp_path, run, model, **{"embedded.max_steps": 2})
    assert rc == 0, out
    rows = [json.loads(line) for line in (tmp_path / "runs" / run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/raw_reward" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    assert len(steps) == 2 and all("rollout/search_rate" in r for r in steps)
    assert {k for r in steps for k in r if k.endswith("/groups") and k.startswith("worker/") and r[k]} == \
        {"worker/local-1/groups", "worker/local-2/groups"}  # the torch and the MLX worker both fed the learner
    assert evals and all({"eval/search_rate", "eval/correct_after_search"} <= set(r) for r in evals)
    assert (tmp_path / "runs" / run / "plots" / "psqa_eval.png").exists()
    assert "held-out cover-EM" in out and "search rate" in out and "make psqa RUN=psqa-e2e" in out
    assert "retriever http://127.0.0.1:" in out
    logs = {p.name: p.read_text() for p in (tmp_path / "runs" / run).glob("worker-*.log")}
    assert "mlx" in logs["worker-2.log"].lower() and "retriever http://127.0.0.1:" in logs["worker-1.log"]
    v = _verify(tmp_path, run)
    assert v.returncode == 0, v.stdout + v.stderr
    assert _leftovers(tmp_path) == []

    metrics = tmp_path / "runs" / run / "metrics.jsonl"

    def interrupt_after_one_more_step():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if metrics.read_text().count("rollout/raw_reward") >= 3:
                os.kill(os.getpid(), signal.SIGINT)  # what a terminal's Ctrl-C delivers to the launcher
                return
            time.sleep(0.2)

    t = threading.Thread(target=interrupt_after_one_more_step, daemon=True)
    t.start()
    rc, out = _run(tmp_path, run, model, **{"embedded.max_steps": 1000})
    t.join()
    assert rc == 130 and "stopped by Ctrl-C" in out, out
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if "rollout/raw_reward" in line]
    assert steps[:3] == [1, 2, 3]  # resumed from the first session's checkpoint
    assert _wait_gone(tmp_path) == []  # the retriever too
    v = _verify(tmp_path, run)
    assert v.returncode == 0, v.stdout + v.stderr


def test_the_data_cache_follows_the_generator(tmp_path, monkeypatch):
    """A data set written by an older generator is never reused: its version is in the cache's name."""
    from embedded import psqa_synth
    from embedded.config import resolve_embedded
    from embedded.psqa import data_dir
    from embedded.run import EmbeddedPaths

    cfg = resolve_embedded("psqa", env={"DRL_RUN": "cache-1"})
    paths = EmbeddedPaths(root=tmp_path, run="cache-1")
    now = data_dir(cfg, paths)
    monkeypatch.setattr(psqa_synth, "GENERATOR_VERSION", psqa_synth.GENERATOR_VERSION + 1)
    assert data_dir(cfg, paths) != now
