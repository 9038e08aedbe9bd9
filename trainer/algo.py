"""The learner's objective (derived in docs/objective.md): dual-clip PPO on the ratio to the worker's
behaviour log-probs under the asymmetric DPPO gate, plus `kl_coef` times the k3 KL to the frozen
reference, on Dr.GRPO advantages (reward minus group mean).

The pieces every objective is built from: trainer/objectives.py composes them into the registered objectives
and the native engine's loss (`objective_loss`); slime runs the recipe's objective from these same functions
(trainer/slime_plugin/objective.py). The names below are fixed: outside checks call them.
More in docs/objective.md (module notes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: ratio = exp(logp - behavior_logp) is computed with the log difference clamped to this range
LOG_RATIO_CLAMP = 20.0
#: slack allowed in the gate's threshold comparison: p = exp(logp) does not round-trip exactly, and a
#: divergence written exactly at the threshold must stay kept (the rule is strict `>`)
GATE_TOLERANCE = 1e-6
_P_MAX = 1.0 - 1e-7  # keeps log(1 - p) finite in the Binary-KL


def drgrpo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO advantages: each reward minus its group's mean, no division by the std.

    `rewards` is `[groups, n]`; the result has the same shape.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be shaped [groups, n], got {tuple(rewards.shape)}")
    return rewards - rewards.mean(dim=-1, keepdim=True)


def group_advantages(rewards: Sequence[float], n: int) -> list[float]:
    """Dr.GRPO advantages of a flat, group-contiguous list of rewards (groups of `n`), as floats.

    The one place both engines turn rewards into advantages: the native batch (trainer/step.py) and
    slime's reward post-process hook (trainer/slime_plugin/objective.py).
    """
    if n < 1 or len(rewards) % n:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {n}")
    adv = drgrpo_advantages(torch.tensor([float(r) for r in rewards], dtype=torch.float64).view(-1, n))
    return [float(a) for a in adv.flatten()]


def _binary_kl(p_mu: torch.Tensor, logp_mu: torch.Tensor, p: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(Bernoulli(p_mu) || Bernoulli(p)): the sampled token against everything else."""
    first = p_mu * (logp_mu - logp)
    second = (1.0 - p_mu) * (torch.log1p(-p_mu.clamp(max=_P_MAX)) - torch.log1p(-p.clamp(max=_P_MAX)))
    return first + second


def dppo_keep_mask(
    logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    advantages: torch.Tensor,
    delta_low: float,
    delta_high: float,
    divergence: str = "tv",
) -> torch.Tensor:
    """The asymmetric DPPO gate: True where a token keeps its gradient.

    A token is dropped only when it has already left the trust region in the direction its advantage
    pushes it: A > 0 and p rose above p_behavior by more than `delta_high`; A <= 0 and p fell below
    p_behavior by more than `delta_low`. `divergence` picks the measure: "tv" = |p - p_behavior|,
    "kl" = KL(Bernoulli(p_behavior) || Bernoulli(p)). Exactly at the threshold is kept.
    `advantages` broadcasts against `logp` (per sequence `[B, 1]` or per token).
    """
    if divergence not in ("tv", "kl"):
        raise ValueError(f"divergence={divergence!r} is not known; use 'tv' (Binary-TV) or 'kl' (Binary-KL)")
    # float64 so the comparison against the threshold is as exact as the inputs allow
    logp = logp.detach().double()
    logp_mu = behavior_logp.detach().double()
    adv = torch.as_tensor(advantages).detach().to(logp.device)
    p, p_mu = logp.exp(), logp_mu.exp()
    rose, fell = p > p_mu, p < p_mu
    if divergence == "tv":
        dist = (p - p_mu).abs()
    else:
        dist = _binary_kl(p_mu, logp_mu, p, logp)
    out_high = rose & (dist > delta_high + GATE_TOLERANCE)
    out_low = fell & (dist > delta_low + GATE_TOLERANCE)
    dropped = torch.where(adv > 0, out_high, out_low)
    return ~dropped


def ratio_from_logp(logp: torch.Tensor, behavior_logp: torch.Tensor) -> torch.Tensor:
    """pi/mu per token, with the log difference clamped to +-20 so it stays finite."""
    return torch.exp((logp - behavior_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def ppo_clip_loss(ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """Per-token plain PPO clipped loss (to minimise): -min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)."""
    adv = torch.as_tensor(advantages, dtype=ratio.dtype, device=ratio.device)
    return -torch.minimum(ratio * adv, ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv)


def dual_clip_loss(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float, c: float
) -> torch.Tensor:
    """Per-token dual-clip PPO loss (to minimise).

    L = min(r*A, clip(r, 1-eps_low, 1+eps_high)*A); for A < 0, L = max(L, c*A); the loss is -L, so a
    negative-advantage token never costs more than c*|A| however large its ratio grows.
    """
    if c <= 1:
        raise ValueError(f"dual-clip constant c={c} must be > 1 (algo.eps_clip_c; the paper uses 3)")
    adv = torch.as_tensor(advantages, dtype=ratio.dtype, device=ratio.device)
    loss = ppo_clip_loss(ratio, adv, eps_low, eps_high)
    return torch.where(adv < 0, torch.minimum(loss, -c * adv), loss)


def no_is_loss(logp: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Per-token policy-gradient loss with no importance correction: -A * pi/sg(pi).

    Its value is -A and its gradient -A * grad log pi whichever policy sampled the token: stale groups are
    trained on as if they were on-policy (the baseline `algo.objective: no_is` measures against).
    """
    adv = torch.as_tensor(advantages, dtype=logp.dtype, device=logp.device)
    return -adv * torch.exp(logp - logp.detach())


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 ("low-variance") KL estimate to the reference: exp(d) - d - 1, d = ref - logp.

    d is clamped to [-20, 20] and the result to at most 10, as in the usual implementation.
    """
    d = (ref_logp - logp).clamp(-20.0, 20.0)
    return (torch.exp(d) - d - 1.0).clamp(max=10.0)


def drgrpo_reduce(values: torch.Tensor, mask: torch.Tensor, max_len: int) -> torch.Tensor:
    """Dr.GRPO reducer: sum(mask * values) / (rows * max_len), a constant denominator.

    rows = values.shape[0]; a constant length keeps long and short responses weighted per token.
    """
    if max_len <= 0:
        raise ValueError(f"max_len={max_len} must be positive (algo.max_new_tokens)")
    rows = values.shape[0]
    return (values * mask.to(values.dtype)).sum() / (rows * max_len)


def sequence_mean_reduce(values: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean over rows of sum(keep * values) / max(sum(mask), 1) per row.

    `keep` selects the tokens that contribute (the gate's survivors within the loss mask); `mask` counts
    the row's trained tokens for the denominator, so a gated token lowers the row's mean instead of
    re-weighting the others (slime's rejection masks do the same).
    """
    keep = keep.to(values.dtype)
    per_row = (values * keep).sum(dim=-1) / mask.to(values.dtype).sum(dim=-1).clamp(min=1.0)
    return per_row.sum() / values.shape[0]
