"""bench.gpu_loop's summaries (CPU, no GPU): the window's busy share beside the fed one, learning's last
and mean of the last three beside the best, and the validation problems a base stops on."""

from __future__ import annotations

from types import SimpleNamespace

from bench.common import validation_problems
from bench.gpu_loop import summary_learning, summary_throughput
from worker_contract.tasks import get_task


def test_the_window_share_counts_the_waits_the_fed_share_leaves_out() -> None:
    # steps of 2 s, 10 s apart, 8 s of each gap waiting for rollouts; the window is 105-145 s
    rows = [{"step": i, "time": 100.0 + 10 * i, "train/step_time_s": 2.0, "learner/wait_s": 8.0,
             "train/grad_norm": 1.0} for i in range(1, 5)]
    rows.append({"step": 5, "time": 150.0, "train/step_time_s": 2.0, "learner/wait_s": 8.0, "train/grad_norm": 1.0})
    out = summary_throughput(rows, 40.0, 2, 1.0, {}, SimpleNamespace(lags=[], error=None), (105.0, 145.0))
    assert out["busy_share_fed"] == 1.0  # every second not spent waiting was in a step
    assert out["steps_in_window"] == 4 and out["busy_share_window"] == 0.2  # 8 s in steps over 40 s
    assert out["steps"] == 5  # the step after the window is not in it


def test_learning_reports_the_last_and_the_mean_of_the_last_three_beside_the_best() -> None:
    accs = [0.50, 0.60, 0.80, 0.62, 0.64, 0.66]
    evals = [{"step": 10 * i, "eval/version": i, "eval/accuracy": a} for i, a in enumerate(accs)]
    out = summary_learning([{"step": 50}], evals, 60.0, 3)
    assert out["heldout_best"] == 0.80 and out["heldout_last"] == 0.66
    assert abs(out["heldout_mean_last3"] - 0.64) < 1e-12 and out["gain_mean_last3_points"] == 14.0
    assert out["gain_best_points"] == 30.0 and out["gain_last_points"] == 16.0


def test_validation_problems_are_neither_test_problems_nor_supervised_ones() -> None:
    task = get_task("arithmetic")
    val = validation_problems(task, 50)
    test_q = {p.question for p in task.dataset("test")[:1000]}
    assert len(val) == 50 and all(p.id.startswith("arith-train-") for p in val)
    assert not {p.question for p in val} & test_q
    # supervision reads training problems from index 0 on (the learning base's 600 steps x 64 rows)
    assert min(int(p.id.rsplit("-", 1)[1]) for p in val) > 600 * 64
