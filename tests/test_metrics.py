"""Learner metrics: the JSONL file, the optional sinks' messages, and stats objects the operator view reads."""

from __future__ import annotations

import json
import math

import pytest

from trainer.metrics import (
    MetricsLogger,
    OptionalDependencyError,
    read_metrics,
    version_stats,
    write_version_stats,
)
from worker_contract import layout
from worker_contract.store.file import FileStore


def test_jsonl_always_written_non_finite_values_become_null(tmp_path):
    log = MetricsLogger(tmp_path, "r", env={})
    log.log(1, {"train/loss": 0.5, "train/ratio_max": math.inf, "rollout/groups": [["k", 1]]})
    log.log(2, {"train/loss": math.nan})
    log.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["train/ratio_max"] is None and rows[0]["rollout/groups"] == [["k", 1]]
    assert rows[1]["train/loss"] is None
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "train/lo')  # a line torn by a crash is skipped, not fatal
    assert len(read_metrics(tmp_path)) == 2


@pytest.mark.parametrize("env,package", [({"DRL_WANDB_PROJECT": "stoa"}, "wandb"),
                                         ({"DRL_TENSORBOARD": "1"}, "tensorboard")])
def test_an_asked_for_sink_that_is_not_installed_says_how_to_get_it(tmp_path, env, package):
    pytest.importorskip("torch")
    try:
        __import__(package)
        pytest.skip(f"{package} is installed here")
    except ImportError:
        pass
    with pytest.raises(OptionalDependencyError, match=f"pip install {package}"):
        MetricsLogger(tmp_path, "r", env=env)
    assert not (tmp_path / "metrics.jsonl").exists() or (tmp_path / "metrics.jsonl").read_text() == ""


def test_stats_objects_carry_the_documented_fields(tmp_path):
    """The format docs/contract.md documents and `invoke status` reads: deltas add up to the totals."""
    store = FileStore(tmp_path)
    totals: dict[str, int] = {}
    for v, delta in ((1, {}), (2, {"stale": 2}), (3, {"stale": 1, "group_size": 1})):
        for k, n in delta.items():
            totals[k] = totals.get(k, 0) + n
        stats = version_stats(
            version=v, step=v - 1, kind="anchor" if v == 1 else "patch",
            metrics={"train/loss": 0.1, "worker/w1/groups": 3.0, "publish/bytes": 1.0},
            drops_total=dict(totals), drops_delta=delta,
            workers={"w1": {"groups": 3, "version_lag": 1}}, groups=8,
            publish={"patch_bytes": 100 * v, "latency_s": 0.5, "ratio": math.nan})
        assert write_version_stats(store, "r", stats)
    objs = [json.loads(store.get(layout.stats_key("r", v))) for v in (1, 2, 3)]
    assert [o["version"] for o in objs] == [1, 2, 3] and objs[0]["kind"] == "anchor"
    summed: dict[str, int] = {}
    for o in objs:
        for k, n in o["drops"].items():
            summed[k] = summed.get(k, 0) + n
    assert summed == objs[-1]["drops_total"] == {"stale": 3, "group_size": 1}
    last = objs[-1]
    assert last["publish"] == {"patch_bytes": 300, "latency_s": 0.5, "ratio": None} and last["groups"] == 8
    assert last["metrics"] == {"train/loss": 0.1}  # per-worker and stale publish values are not repeated
    assert last["workers"] == {"w1": {"groups": 3, "version_lag": 1}}


def test_a_torn_last_line_is_not_glued_to_the_next_session(tmp_path):
    """A learner killed mid-line left `{"step": 7, "rew`; the next session's first row was glued to it and lost."""
    from trainer.metrics import read_metrics

    (tmp_path / "metrics.jsonl").write_text('{"step": 6, "reward": 0.5}\n{"step": 7, "rew')
    log = MetricsLogger(tmp_path, "r", env={})
    log.log(8, {"reward": 0.25})
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [6, 8]
