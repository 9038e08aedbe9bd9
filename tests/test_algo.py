"""The objective against hand-computed values, including the threshold and sign edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.algo import (
    dppo_keep_mask,
    drgrpo_advantages,
    drgrpo_reduce,
    dual_clip_loss,
    k3_kl,
    sequence_mean_reduce,
)
from trainer.config import AlgoConfig, GateConfig
from trainer.objectives import policy_loss

L = math.log


def t(*xs, dtype=torch.float64):
    return torch.tensor(xs, dtype=dtype)


# -- Dr.GRPO advantages --------------------------------------------------------------------------------
def test_drgrpo_advantages_is_reward_minus_group_mean_without_std():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [3.0, 0.0, 0.0, 0.0]])
    adv = drgrpo_advantages(rewards)
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0], [2.25, -0.75, -0.75, -0.75]])
    assert torch.equal(adv, expected)  # GRPO would divide row 0 by its std (0.577) and row 2 by 1.5


def test_drgrpo_advantages_refuses_flat_rewards():
    with pytest.raises(ValueError, match="groups, n"):
        drgrpo_advantages(torch.zeros(8))


# -- DPPO gate ------------------------------------------------------------------------------------------
def test_tv_gate_drops_only_in_the_advantage_direction():
    p_mu = 0.5
    # p values: rose by .3, rose by .1, fell by .3, fell by .1
    p = [0.8, 0.6, 0.2, 0.4]
    logp, blp = t(*map(L, p)), t(*[L(p_mu)] * 4)
    pos = dppo_keep_mask(logp, blp, t(1.0, 1.0, 1.0, 1.0), 0.2, 0.2, "tv")
    neg = dppo_keep_mask(logp, blp, t(-1.0, -1.0, -1.0, -1.0), 0.2, 0.2, "tv")
    assert pos.tolist() == [False, True, True, True]  # A>0: only "rose past delta_high" is dropped
    assert neg.tolist() == [True, True, False, True]  # A<0: only "fell past delta_low" is dropped


def test_tv_gate_zero_advantage_takes_the_negative_branch():
    logp, blp = t(L(0.8), L(0.2)), t(L(0.5), L(0.5))
    assert dppo_keep_mask(logp, blp, t(0.0, 0.0), 0.2, 0.2, "tv").tolist() == [True, False]


def test_tv_gate_thresholds_are_separate_and_exact_threshold_is_kept():
    blp = t(L(0.5), L(0.5))
    # exactly at the threshold (0.75 - 0.5 = 0.25 = delta_high; 0.5 - 0.4 = 0.1 = delta_low): kept
    at = dppo_keep_mask(t(L(0.75), L(0.4)), blp, t(1.0, -1.0), 0.1, 0.25, "tv")
    assert at.tolist() == [True, True]
    # just past each threshold: dropped
    past = dppo_keep_mask(t(L(0.7501), L(0.3999)), blp, t(1.0, -1.0), 0.1, 0.25, "tv")
    assert past.tolist() == [False, False]
    # asymmetric: a rise of 0.2 passes delta_high=0.25 but a fall of 0.2 fails delta_low=0.1
    asym = dppo_keep_mask(t(L(0.7), L(0.3)), blp, t(1.0, -1.0), 0.1, 0.25, "tv")
    assert asym.tolist() == [True, False]


def test_gate_works_in_float32_at_the_threshold():
    logp = torch.log(torch.tensor([0.75, 0.25], dtype=torch.float32))
    blp = torch.log(torch.tensor([0.5, 0.5], dtype=torch.float32))
    assert dppo_keep_mask(logp, blp, torch.tensor([1.0, -1.0]), 0.25, 0.25).tolist() == [True, True]


def _bkl(pm, p):
    return pm * math.log(pm / p) + (1 - pm) * math.log((1 - pm) / (1 - p))


def test_kl_gate_uses_bernoulli_kl_from_the_behaviour_side():
    pm = 0.5
    # KL(Bern(.5)||Bern(.8)) = 0.2231; (.5||.6) = 0.0204; (.5||.2) = 0.2231; (.5||.4) = 0.0204
    assert _bkl(0.5, 0.8) == pytest.approx(0.22314, abs=1e-5)
    logp, blp = t(L(0.8), L(0.6), L(0.2), L(0.4)), t(*[L(pm)] * 4)
    pos = dppo_keep_mask(logp, blp, t(1.0, 1.0, 1.0, 1.0), 0.05, 0.05, "kl")
    neg = dppo_keep_mask(logp, blp, t(-1.0, -1.0, -1.0, -1.0), 0.05, 0.05, "kl")
    assert pos.tolist() == [False, True, True, True]
    assert neg.tolist() == [True, True, False, True]
    # the KL is asymmetric where TV is not: (.1 -> .3) and (.3 -> .1) move TV by .2 both ways
    up, down = _bkl(0.1, 0.3), _bkl(0.3, 0.1)
    thr = (up + down) / 2  # up = 0.1446 < thr = 0.1544 < down = 0.1643
    assert up < thr < down
    m = dppo_keep_mask(t(L(0.3), L(0.1)), t(L(0.1), L(0.3)), t(1.0, -1.0), thr, thr, "kl")
    assert m.tolist() == [True, False]
    # exactly at the threshold: kept
    exact = dppo_keep_mask(t(L(0.3)), t(L(0.1)), t(1.0), up, up, "kl")
    assert exact.tolist() == [True]


def test_gate_refuses_an_unknown_divergence():
    with pytest.raises(ValueError, match="divergence='js'"):
        dppo_keep_mask(t(0.0), t(0.0), t(1.0), 0.1, 0.1, "js")


# -- dual clip --------------------------------------------------------------------------------------------
def test_dual_clip_positive_advantage():
    r = t(0.5, 1.0, 1.1, 1.5)
    loss = dual_clip_loss(r, t(2.0, 2.0, 2.0, 2.0), 0.2, 0.28, 3.0)
    # min(r*A, clip(r,.8,1.28)*A): .5 -> min(1, 1.6) = 1; 1 -> 2; 1.1 -> 2.2; 1.5 -> min(3, 2.56) = 2.56
    assert torch.allclose(loss, -t(1.0, 2.0, 2.2, 2.56))


def test_dual_clip_negative_advantage_caps_the_loss_at_c_abs_a():
    r = t(0.5, 1.0, 2.0, 5.0)
    loss = dual_clip_loss(r, t(-1.0, -1.0, -1.0, -1.0), 0.2, 0.28, 3.0)
    # min(-r, -clip(r)): .5 -> min(-.5, -.8) = -.8; 1 -> -1; 2 -> min(-2, -1.28) = -2; 5 -> -5
    # then max(., c*A = -3): -.8, -1, -2, -3
    assert torch.allclose(loss, t(0.8, 1.0, 2.0, 3.0))


def test_dual_clip_zero_advantage_is_zero_and_c_must_exceed_one():
    assert torch.equal(dual_clip_loss(t(0.1, 9.0), t(0.0, 0.0), 0.2, 0.2, 3.0), t(0.0, 0.0))
    with pytest.raises(ValueError, match="c=1.0"):
        dual_clip_loss(t(1.0), t(1.0), 0.2, 0.2, 1.0)


def test_dual_clip_gradient_vanishes_where_clipped():
    r = t(0.5, 1.5, 5.0, 1.0).requires_grad_(True)
    dual_clip_loss(r, t(-1.0, 1.0, -1.0, 1.0), 0.2, 0.28, 3.0).sum().backward()
    assert r.grad.tolist() == [0.0, 0.0, 0.0, -1.0]


# -- k3 KL ------------------------------------------------------------------------------------------------
def test_k3_values_and_clamps():
    logp = t(L(0.5), L(0.5), 0.0, 0.0, -30.0)
    ref = t(L(0.5), L(0.25), -1.0, -30.0, 0.0)
    kl = k3_kl(logp, ref)
    d1 = L(0.5)  # ref - logp = log(.25/.5)
    assert kl[0] == 0.0
    assert kl[1] == pytest.approx(math.exp(d1) - d1 - 1)  # 0.5 + 0.6931 - 1 = 0.19315
    assert kl[2] == pytest.approx(math.exp(-1) + 1 - 1)
    assert kl[3] == 10.0  # d = -30 -> clamped to -20 -> e^-20 + 19 -> capped at 10
    assert kl[4] == 10.0  # d = 30 -> clamped to 20 -> e^20 - 21 -> capped at 10
    assert k3_kl(t(0.0), t(-9.0)).item() == pytest.approx(math.exp(-9) + 8)  # 8.0001 < 10, not capped


# -- reducer ---------------------------------------------------------------------------------------------
def test_drgrpo_reduce_divides_by_rows_times_max_len():
    values = t(1.0, 2.0, 3.0, 4.0, 5.0, 6.0).reshape(2, 3)
    mask = t(1, 1, 0, 1, 0, 0)
    assert drgrpo_reduce(values, mask.reshape(2, 3), 10).item() == pytest.approx((1 + 2 + 4) / 20)
    with pytest.raises(ValueError, match="max_len=0"):
        drgrpo_reduce(values, mask.reshape(2, 3), 0)


def test_sequence_mean_reduce_keeps_the_trained_token_count_as_denominator():
    values = t(1.0, 2.0, 3.0, 4.0, 5.0, 6.0).reshape(2, 3)
    mask = t(1, 1, 0, 0, 0, 0).reshape(2, 3)  # row 1 trains nothing: it adds 0, but still counts as a row
    keep = t(1, 0, 0, 0, 0, 0).reshape(2, 3)  # (0,1) gated: it leaves the sum, not the denominator
    assert sequence_mean_reduce(values, keep, mask).item() == pytest.approx((1 / 2 + 0) / 2)


# -- composed loss -------------------------------------------------------------------------------------
def _cfg(**kw) -> AlgoConfig:
    base = dict(max_new_tokens=4, kl_coef=0.5, eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=3.0,
                gate=GateConfig(divergence="tv", delta_low=0.2, delta_high=0.2))
    base.update(kw)
    return AlgoConfig(**base)


def test_policy_loss_composes_gate_dual_clip_kl_and_reducer():
    # row 0 (A = +1): tokens p 0.5->0.5 (r=1), 0.5->0.8 (rose .3: gate drops), pad
    # row 1 (A = -1): tokens p 0.5->0.25 (fell .25: gate drops), 0.5->0.6 (r=1.2), 0.5->0.5 (masked out)
    logp = t(L(0.5), L(0.8), 0.0, L(0.25), L(0.6), L(0.5)).reshape(2, 3).requires_grad_(True)
    blp = t(*[L(0.5)] * 6).reshape(2, 3)
    ref = t(L(0.5), L(0.8), 0.0, L(0.25), L(0.3), L(0.5)).reshape(2, 3)
    mask = t(1, 1, 0, 1, 1, 0).reshape(2, 3)
    adv = t(1.0, -1.0)
    loss, m = policy_loss(logp, blp, ref, adv, mask, _cfg())
    # policy: kept tokens are (0,0): -1*1 = -1 and (1,1): -min(-1.2, -1.2) = 1.2 -> sum 0.2, over rows x max_len
    # kl: only (1,1) differs: d = log(.3/.6), k3 = .5 + .6931 - 1 = .19315; row 1 trains 2 tokens, so its
    # per-sequence mean is k3 / 2 (the gated (1,0) counts in the denominator), and the mean over 2 rows halves it
    d = L(0.5)
    expected = 0.2 / (2 * 4) + 0.5 * (math.exp(d) - d - 1) / 2 / 2
    assert loss.item() == pytest.approx(expected)
    assert m["gate_drop_frac"] == pytest.approx(2 / 4)
    assert m["ratio_max"] == pytest.approx(1.6) and m["ratio_min"] == pytest.approx(0.5)
    assert m["clip_high_frac"] == pytest.approx(1 / 4)  # (0,1): A>0, r=1.6 > 1.28
    assert m["clip_low_frac"] == pytest.approx(1 / 4)  # (1,0): A<0, r=0.5 < 0.8
    assert m["clip_dual_frac"] == 0.0
    loss.backward()
    # gated tokens and masked positions get no policy gradient
    assert logp.grad[0, 1] == 0.0 and logp.grad[0, 2] == 0.0 and logp.grad[1, 2] == 0.0
    assert logp.grad[1, 0] == 0.0  # gated (and its k3 term is 0 because ref == logp there)


def test_policy_loss_without_reference_has_no_kl():
    logp = t(L(0.5), L(0.4)).reshape(1, 2)
    loss, m = policy_loss(logp, logp.clone(), None, t(1.0), torch.ones(1, 2), _cfg())
    assert loss.item() == pytest.approx(-2 / 4) and m["kl_mean"] == 0.0


# -- the objective registry: the default's loss pinned, a registered term runs -------------------------------
def _seeded_batch():
    g = torch.Generator().manual_seed(1234)
    b, r = 6, 9
    logp = (-torch.rand(b, r, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    blp = (logp.detach() + torch.randn(b, r, generator=g, dtype=torch.float64) * 0.4).clamp(max=0.0)
    ref = logp.detach() + torch.randn(b, r, generator=g, dtype=torch.float64) * 0.2
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, r, generator=g) > 0.25).to(torch.float64)
    return logp, blp, ref, adv, mask


#: loss, sum of the gradient, sum of its squares and the gate's drop share on `_seeded_batch`, computed by
#: policy_loss at 14719cb (before the objectives became a registry over LossInputs): refactors keep them exactly
PINNED = {
    "recipe": (-0.003830370936795874, 0.013995888659457669, 0.0018122104819194376, 0.06976744186046512),
    "ppo": (-0.02639890159872998, 0.013600958945473208, 0.0018122632702771318, 0.0),
    "no_is": (-0.061875835876655974, -0.06121182992407136, 0.0025053327377044157, 0.0),
}


@pytest.mark.parametrize("objective", sorted(PINNED))
def test_each_built_in_objective_gives_the_pinned_loss_on_a_fixed_seed(objective):
    from trainer.objectives import LossInputs, objective_loss

    logp, blp, ref, adv, mask = _seeded_batch()
    cfg = AlgoConfig(objective=objective, max_new_tokens=12, kl_coef=0.05)
    loss, m = objective_loss(LossInputs.make(logp, blp, ref, adv, mask), cfg)
    loss.backward()
    got = (loss.item(), float(logp.grad.sum()), float((logp.grad ** 2).sum()), m["gate_drop_frac"])
    assert got == pytest.approx(PINNED[objective], rel=1e-12, abs=1e-15)


def test_a_registered_objective_is_what_the_loss_runs_and_slime_refuses_it():
    from trainer.config import resolve
    from trainer.objectives import OBJECTIVES, PolicyTerm, register_objective

    calls = []

    @register_objective("test-half-no-is")
    def half(x, algo):
        calls.append(x.advantages.shape)
        return PolicyTerm(-0.5 * x.advantages * torch.exp(x.logprobs - x.logprobs.detach()),
                          torch.ones_like(x.loss_mask, dtype=torch.bool))

    try:
        logp, blp, ref, adv, mask = _seeded_batch()
        loss, _ = policy_loss(logp, blp, None, adv, mask, AlgoConfig(objective="test-half-no-is", max_new_tokens=12))
        want, _ = policy_loss(logp, blp, None, adv, mask, AlgoConfig(objective="no_is", max_new_tokens=12))
        assert calls == [(6, 9)] and loss.item() == pytest.approx(want.item() / 2)
        with pytest.raises(ValueError, match="taken"):
            register_objective("recipe")(half)
        with pytest.raises(ValueError, match=r"runs on the native engine only .*set train.engine: native") as e:
            resolve("gsm8k", env={}, overrides={"algo.objective": "test-half-no-is", "train.engine": "slime"})
        assert "\n" not in str(e.value)
    finally:
        OBJECTIVES.pop("test-half-no-is", None)
    with pytest.raises(ValueError, match="known objectives: no_is, ppo, recipe"):
        AlgoConfig(objective="test-half-no-is")
