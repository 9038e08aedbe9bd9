"""The staleness sweep's machinery (bench/staleness.py) and the objective variants it compares.

- forced lag: two cells of the smoke preset (an untrained 2-layer model, a few steps) through the real
  publisher, lagging reference worker, rollout source and learner step; every group the learner used is
  exactly k versions older than the learner, read from the records themselves;
- `algo.objective`: recipe, ppo and no_is on three hand-built tokens (loss values and gradients computed
  by hand in the comments).
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from bench import staleness  # noqa: E402
from trainer.config import AlgoConfig  # noqa: E402
from trainer.objectives import policy_loss  # noqa: E402


@pytest.fixture(scope="module")
def smoke_base(tmp_path_factory):
    work = tmp_path_factory.mktemp("staleness")
    base_dir, report = staleness.build_base(staleness.PRESETS["smoke"], work, log=lambda _msg: None)
    return work, base_dir


@pytest.mark.integration
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


# Three tokens of one row, R = max_new_tokens = 3, so the Dr.GRPO reducer divides by 1 x 3:
#   t1: A = +1, mu = 0.5, p = 0.9: ratio 1.8; p rose 0.4 past mu (> delta 0.2) in A's direction
#   t2: A = -1, mu = 0.1, p = 0.5: ratio 5; p rose, against A's push (the gate keeps it)
#   t3: A = +1, mu = 0.5, p = 0.55: ratio 1.1, inside every clip
# per-token loss, and its derivative in logp:
#   recipe: t1 gated -> 0 (d 0); t2 dual-clip: max(min(-5, -1.28), 3 * -1) = -3 -> +3 (d 0); t3 -1.1 (d -1.1)
#   ppo:    t1 -min(1.8, 1.28) = -1.28 (d 0); t2 -min(-5, -1.28) = +5 (d -A r = 5); t3 -1.1 (d -1.1)
#   no_is:  -A each: -1, +1, -1 (d -A: -1, +1, -1), whatever mu is
HAND = {
    "recipe": (0 + 3 - 1.1, [0.0, 0.0, -1.1], 1 / 3),
    "ppo": (-1.28 + 5 - 1.1, [0.0, 5.0, -1.1], 0.0),
    "no_is": (-1 + 1 - 1, [-1.0, 1.0, -1.0], 0.0),
}


def _tokens(mu=(0.5, 0.1, 0.5)):
    logp = torch.tensor([[math.log(0.9), math.log(0.5), math.log(0.55)]], dtype=torch.float64, requires_grad=True)
    behavior = torch.tensor([[math.log(m) for m in mu]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, 1.0]], dtype=torch.float64)
    return logp, behavior, adv, torch.ones(1, 3)


@pytest.mark.parametrize("objective", list(HAND))
def test_objective_variants_compute_what_they_claim(objective):
    cfg = AlgoConfig(objective=objective, max_new_tokens=3, kl_coef=0.0)
    logp, behavior, adv, mask = _tokens()
    loss, metrics = policy_loss(logp, behavior, None, adv, mask, cfg)
    loss.backward()
    value, grad, dropped = HAND[objective]
    assert float(loss) == pytest.approx(value / 3, abs=1e-9)
    assert logp.grad[0].tolist() == pytest.approx([g / 3 for g in grad], abs=1e-9)
    assert metrics["gate_drop_frac"] == pytest.approx(dropped)


def test_no_is_ignores_the_behaviour_policy_and_ppo_does_not():
    grads = {}
    for objective in ("no_is", "ppo"):
        for mu in ((0.5, 0.1, 0.5), (0.2, 0.45, 0.6)):
            logp, behavior, adv, mask = _tokens(mu)
            loss, _ = policy_loss(logp, behavior, None, adv, mask,
                                  AlgoConfig(objective=objective, max_new_tokens=3, kl_coef=0.0))
            loss.backward()
            grads[objective, mu] = logp.grad[0].tolist()
    assert grads["no_is", (0.5, 0.1, 0.5)] == grads["no_is", (0.2, 0.45, 0.6)]
    assert grads["ppo", (0.5, 0.1, 0.5)] != grads["ppo", (0.2, 0.45, 0.6)]


def test_unknown_objective_is_refused():
    with pytest.raises(ValueError, match="objective"):
        AlgoConfig(objective="reinforce")


def test_a_variant_objective_on_the_slime_engine_is_refused_in_one_sentence():
    from trainer.config import resolve

    with pytest.raises(ValueError, match=r"algo.objective='no_is' runs on the native engine only") as e:
        resolve("psqa", env={}, overrides={"algo.objective": "no_is", "train.engine": "slime"})
    assert "\n" not in str(e.value)
    assert resolve("psqa", env={}, overrides={"algo.objective": "no_is", "train.engine": "native"}).algo.objective == "no_is"
