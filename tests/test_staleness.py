"""The staleness sweep's machinery (bench/staleness.py) and the objective variants it compares.

- forced lag: two cells of the smoke preset (an untrained 2-layer model, a few steps) through the real
  publisher, lagging reference worker, rollout source and learner step; every group the learner used is
  exactly k versions older than the learner, read from the records themselves;
- `algo.objective`: an unknown value is refused.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from bench import staleness  # noqa: E402
from trainer.config import AlgoConfig  # noqa: E402


@pytest.fixture(scope="module")
def smoke_base(tmp_path_factory):
    work = tmp_path_factory.mktemp("staleness")
    base_dir, report = staleness.build_base(staleness.PRESETS["smoke"], work, log=lambda _msg: None)
    return work, base_dir


@pytest.mark.parametrize("objective,lag", [("recipe", 2), ("no_is", 1)])
def test_forced_lag_gives_groups_exactly_k_versions_old(smoke_base, objective, lag):
    work, base_dir = smoke_base
    preset = staleness.PRESETS["smoke"]
    res = staleness.run_cell(staleness.Cell(objective, lag, 0), preset, base_dir, str(work))
    steps = res["per_step"]
    assert len(steps) == preset.steps
    groups = preset.recipe["algo.groups_per_step"]
    for i, s in enumerate(steps):
        # the learner moves one version per step; the run published the base lag+1 times first
        assert s["learner_version"] == 1 + lag + i
        assert s["worker_version"] == s["learner_version"] - lag
        assert s["group_versions"] == [s["learner_version"] - lag] * groups, s
        assert s["uses"] == [1] * groups  # each group used once: its age is exactly the lag
    assert res["lags_seen"] == [lag]
    assert res["staleness_bound"] == max(lag, 3) and res["drops"].get("stale", 0) == 0
    assert res["curve"][0][0] == 0 and res["curve"][-1][0] == preset.steps
    assert all(0.0 <= acc <= 1.0 for _, acc in res["curve"])


def test_unknown_objective_is_refused():
    with pytest.raises(ValueError, match="objective"):
        AlgoConfig(objective="reinforce")
